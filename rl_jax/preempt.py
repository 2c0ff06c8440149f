"""Preemption: SIGTERM / SIGINT end a job at the next step boundary with a checkpoint and exit code 75."""
from __future__ import annotations

import concurrent.futures
import contextlib
import os
import select
import signal
import threading
from typing import Collection

import jax
import numpy as np

# EX_TEMPFAIL: "try again later". Schedulers and launch/ scripts requeue on it; a crash is any other
# non-zero code.
PREEMPTED_EXIT_CODE = 75
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(Exception):
  """The job stopped on a signal after checkpointing `step`; rerunning it resumes there."""

  def __init__(self, step: int | None, signum: int, checkpoint_dir):
    where = (f"stopped after step {step} with its checkpoint in {checkpoint_dir}" if step is not None
             else f"the runs in progress under {checkpoint_dir} checkpointed")
    super().__init__(f"preempted by {signal.Signals(signum).name}: {where}; rerun the same command to resume")
    self.step, self.signum = step, signum


@contextlib.contextmanager
def signals_to_main_thread():
  """SIGTERM / SIGINT unblocked on the calling (main) thread for the block, the old mask restored after.

  Python runs signal handlers only on the main thread, at its next bytecode. The kernel gives a
  signal sent to the process to its main thread when that thread does not block it; there a thread
  asleep on a lock is woken at once (EINTR) and runs the handler. If the main thread blocks the
  signal (a library that masked it and never restored the mask), another thread receives it, and the
  handler waits until the main thread next wakes on its own: the study runner's main thread sleeps
  until a run finishes, so a run could start in the meantime. Off the main thread, or without
  pthread_sigmask, this does nothing.
  """
  if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
    yield
    return
  previous = signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
  try:
    yield
  finally:
    signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class MainThreadWaiter:
  """Waits on the main thread for futures so that a signal's Python handler runs at once.

  Python runs a signal's handler on the main thread only. When the kernel gives the signal to
  another thread (it may: any thread that does not block it), the main thread, asleep on a lock in
  `concurrent.futures.wait`, would run the handler only when it next woke, when a future finished:
  in the study runner, minutes later, after the worker threads had started more runs. Here the main
  thread sleeps in `select` on a pipe that is also Python's signal wakeup fd (`signal.set_wakeup_fd`):
  the C-level handler writes to it from whichever thread received the signal, the main thread wakes
  and runs the handler before its next line. A finished future writes to the same pipe. Off the
  main thread (where no handler is installed either) it is a plain `concurrent.futures.wait`.
  """

  def __init__(self):
    self._r = self._w = None
    self._old_fd = None

  def __enter__(self) -> "MainThreadWaiter":
    if threading.current_thread() is threading.main_thread():
      self._r, self._w = os.pipe()
      os.set_blocking(self._r, False)
      os.set_blocking(self._w, False)
      self._old_fd = signal.set_wakeup_fd(self._w, warn_on_full_buffer=False)
    return self

  def __exit__(self, *exc) -> None:
    if self._r is not None:
      signal.set_wakeup_fd(self._old_fd)
      os.close(self._r)
      os.close(self._w)
      self._r = self._w = None

  def _notify(self, _future=None) -> None:
    try:
      os.write(self._w, b"\0")
    except (BlockingIOError, OSError):   # full: a wake-up is already pending; closed: the wait ended
      pass

  def watch(self, futures: Collection[concurrent.futures.Future]) -> None:
    """Makes each of `futures` wake `wait` when it finishes."""
    if self._r is not None:
      for f in futures:
        f.add_done_callback(self._notify)

  def wait(self, futures: Collection[concurrent.futures.Future]) -> set:
    """The finished ones of `futures` (watched first), once at least one has finished."""
    if self._r is None:
      return concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_COMPLETED).done
    while True:
      done = {f for f in futures if f.done()}
      if done:
        return done
      select.select([self._r], [], [])   # a signal (any thread) or a finished future
      try:
        while os.read(self._r, 4096):
          pass
      except BlockingIOError:
        pass


class Guard:
  """Installs SIGTERM / SIGINT handlers for the duration of a `with` block.

  The first signal only sets a flag that the loop reads at its next step boundary
  (`stop_requested`); a second one raises KeyboardInterrupt at once (the way out of a hung step).
  Off the main thread (where Python cannot install handlers) the guard is inert.
  """

  def __init__(self, on_signal=None):
    """`on_signal(signum)`: also called on the first signal (e.g. to forward it to child processes)."""
    self.signum: int | None = None
    self.on_signal = on_signal
    self._previous: dict = {}

  def _handle(self, signum, frame):  # pylint: disable=unused-argument
    if self.signum is not None:
      raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: stopping without a checkpoint")
    self.signum = signum
    print(f"[preempt] {signal.Signals(signum).name}: finishing the current step, then checkpointing "
          "and exiting", flush=True)
    if self.on_signal is not None:
      self.on_signal(signum)

  def __enter__(self) -> "Guard":
    if threading.current_thread() is threading.main_thread():
      for s in SIGNALS:
        self._previous[s] = signal.signal(s, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    for s, handler in self._previous.items():
      signal.signal(s, handler)
    self._previous = {}

  def stop_requested(self) -> bool:
    """True when any process got a signal: every process stops after the same step.

    On several processes the flags are all-gathered (one tiny collective per step), so a host
    that was signalled and one that was not still agree on the step to checkpoint.
    """
    flag = np.int32(0 if self.signum is None else self.signum)
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      flags = np.asarray(multihost_utils.process_allgather(flag))
      signalled = flags[flags != 0]
      if signalled.size and self.signum is None:
        self.signum = int(signalled[0])
    return self.signum is not None
