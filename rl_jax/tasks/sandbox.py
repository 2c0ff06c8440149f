"""Bounded verifier calls: persistent worker processes, a deadline per call, RLIMIT_AS; a hung call's worker is killed.

Model output is untrusted, and a symbolic comparison can hang inside one C-level big-integer
operation (`9^9^9^9`) where no signal reaches Python, or allocate without bound. Each call
therefore runs in a worker process (`python -m rl_jax.tasks._verifier_worker`, a plain subprocess: no
fork of a JAX process, no re-import of the job's main module) that caps its own address space;
the parent waits for the answer until the call's deadline and otherwise kills the worker,
scores 0 with error 'timeout', and starts a fresh one. Workers persist between calls, so a
call costs one pipe round trip (JSON frames) plus the verifier itself.
"""
from __future__ import annotations

import json
import os
import select
import struct
import subprocess
import sys
import time
from typing import Any, Sequence

# Seconds a new worker may take to import its verifiers (sympy, math-verify) before its first call.
STARTUP_S = 120.0
# Named errors of a call that did not return a verdict (besides a verifier's own codes).
TIMEOUT, MEMORY, CRASHED, RECURSION, EXCEPTION, BAD_RESULT = (
    "timeout", "memory", "worker_crashed", "recursion", "verifier_exception", "bad_result")
HEADER = struct.Struct("<I")
# An exception's text as reported: its last line, cut to this many characters.
DETAIL_CHARS = 300


def exception_text(e: BaseException) -> str:
  """'TypeError: f() takes 3 positional arguments but 4 were given' on one bounded line."""
  lines = str(e).strip().splitlines()
  return f"{type(e).__name__}: {lines[-1] if lines else ''}"[:DETAIL_CHARS]


def write_frame(f, obj) -> None:
  data = json.dumps(obj).encode()
  f.write(HEADER.pack(len(data)) + data)
  f.flush()


def read_exact(fd: int, n: int) -> bytes:
  chunks = []
  while n:
    b = os.read(fd, n)
    if not b:
      raise EOFError
    chunks.append(b)
    n -= len(b)
  return b"".join(chunks)


class _Worker:
  def __init__(self, memory_mb: int):
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("XLA_FLAGS", None)
    self.proc = subprocess.Popen([sys.executable, "-m", "rl_jax.tasks._verifier_worker", str(int(memory_mb))],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    self.fd = self.proc.stdout.fileno()
    self.deadline = 0.0
    self.slot = -1
    # The worker says 'ready' once its imports are done: start-up never counts against a call.
    ready, _, _ = select.select([self.fd], [], [], STARTUP_S)
    try:
      if not ready or self.recv() != "ready":
        raise EOFError
    except (EOFError, OSError, ValueError):
      self.kill()
      raise RuntimeError(f"a verifier worker did not start within {STARTUP_S} s "
                         f"({sys.executable} -m rl_jax.tasks._verifier_worker)") from None

  def send(self, spec: str, args: list, deadline: float, slot: int) -> None:
    write_frame(self.proc.stdin, [spec, args])
    self.deadline, self.slot = deadline, slot

  def recv(self) -> Any:
    (n,) = HEADER.unpack(read_exact(self.fd, HEADER.size))
    return json.loads(read_exact(self.fd, n))

  def kill(self) -> None:
    try:
      self.proc.kill()
    except ProcessLookupError:
      pass
    self.proc.wait()
    for f in (self.proc.stdin, self.proc.stdout):
      try:
        f.close()
      except OSError:
        pass


class Pool:
  """`workers` verifier processes; `run` scores a batch with at most `timeout_s` per call.

  Counters: `restarts` (workers killed on a timeout or found dead) and `calls`.
  """

  def __init__(self, workers: int = 2, timeout_s: float = 5.0, memory_mb: int = 1024):
    self.n, self.timeout_s, self.memory_mb = max(1, int(workers)), float(timeout_s), int(memory_mb)
    self._idle: list[_Worker] = []
    self.restarts = 0
    self.calls = 0

  def _spawn(self) -> _Worker:
    return _Worker(self.memory_mb)

  def run(self, calls: Sequence[tuple[str, list]], details: list | None = None) -> list[tuple[float, str]]:
    """(reward, error) per (verifier spec, args) call, in order; never raises for a call's sake.

    `details` (a list) receives, per call, the text of the exception a verifier raised ('' if none).
    """
    if details is not None:
      details[:] = [""] * len(calls)
    out: list[tuple[float, str] | None] = [None] * len(calls)
    todo = list(range(len(calls)))[::-1]
    busy: dict[int, _Worker] = {}
    while todo or busy:
      while todo and len(busy) < self.n:
        w = self._idle.pop() if self._idle else self._spawn()
        i = todo.pop()
        try:
          w.send(calls[i][0], calls[i][1], time.monotonic() + self.timeout_s, i)
        except (BrokenPipeError, OSError):  # died while idle: replace it and retry the call
          w.kill()
          self.restarts += 1
          todo.append(i)
          continue
        busy[w.fd] = w
      now = time.monotonic()
      wait = max(0.0, min(w.deadline for w in busy.values()) - now)
      ready, _, _ = select.select(list(busy), [], [], wait)
      for fd in ready:
        w = busy.pop(fd)
        try:
          msg = w.recv()
          out[w.slot] = _verdict(msg)
          if details is not None and isinstance(msg, list) and len(msg) == 3:
            details[w.slot] = str(msg[2])[:DETAIL_CHARS]
          self._idle.append(w)
        except (EOFError, OSError, ValueError):
          # Killed by RLIMIT_AS mid-allocation outside Python's reach, or crashed in C.
          out[w.slot] = (0.0, CRASHED)
          w.kill()
          self.restarts += 1
      now = time.monotonic()
      for fd in [fd for fd, w in busy.items() if w.deadline <= now]:
        w = busy.pop(fd)
        out[w.slot] = (0.0, TIMEOUT)
        w.kill()
        self.restarts += 1
    self.calls += len(calls)
    return out  # type: ignore[return-value]

  def close(self) -> None:
    for w in self._idle:
      w.kill()
    self._idle = []

  def __del__(self):
    try:
      self.close()
    except Exception:  # pylint: disable=broad-except
      pass


def _verdict(msg: Any) -> tuple[float, str]:
  if (not isinstance(msg, list) or len(msg) not in (2, 3) or not isinstance(msg[0], (int, float))
      or not isinstance(msg[1], str)):
    return 0.0, BAD_RESULT
  return float(msg[0]), msg[1]
