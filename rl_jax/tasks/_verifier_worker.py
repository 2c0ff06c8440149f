"""The verifier worker process of rl_jax.tasks.sandbox: caps its memory, then answers [spec, args] frames."""
from __future__ import annotations

import json
import sys

from rl_jax.tasks.sandbox import (EXCEPTION, MEMORY, RECURSION, HEADER, exception_text, read_exact,
                                   write_frame)


def serve(memory_mb: int) -> None:
  """The worker loop: cap memory, then answer [spec, args] frames with [reward, error] frames."""
  import resource  # pylint: disable=g-import-not-at-top
  limit = memory_mb * (1 << 20)
  resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
  sys.setrecursionlimit(10_000)
  import logging  # pylint: disable=g-import-not-at-top
  from rl_jax.tasks import verifiers  # pylint: disable=g-import-not-at-top
  logging.getLogger("math_verify").setLevel(logging.CRITICAL)  # its timeouts are our verdicts
  try:  # imported before 'ready', so a call's deadline covers the call only
    import math_verify  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    pass
  else:
    # One grade before 'ready' as well: a process's first LaTeX parse and sympy comparison builds
    # lazy state (0.66 s CPU, 3 s wall on a loaded box, against 7 ms for every later one), which
    # would otherwise fall inside the first call's deadline and math-verify's own 2 s timeouts,
    # and grade a right answer wrong on a busy machine.
    try:
      verifiers.call_local("math", "warm_up", r"\boxed{(x+1)^2}", "x^2+2x+1", {})
    except Exception:  # pylint: disable=broad-except
      pass
  stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
  sys.stdout = sys.stderr  # a verifier's prints must not corrupt the frames
  fd = stdin.fileno()
  write_frame(stdout, "ready")
  while True:
    try:
      (n,) = HEADER.unpack(read_exact(fd, HEADER.size))
      spec, args = json.loads(read_exact(fd, n))
    except EOFError:
      return
    detail = None
    try:
      reward, error = verifiers.call_local(spec, *args)
    except MemoryError:
      reward, error = 0.0, MEMORY
    except RecursionError:
      reward, error = 0.0, RECURSION
    except Exception as e:  # pylint: disable=broad-except
      # The exception's text goes back with the verdict: a verifier that fails on most calls
      # stops the run with it (rl_jax.tasks.dataset), not as a silent zero reward.
      reward, error, detail = 0.0, EXCEPTION, exception_text(e)
    try:
      write_frame(stdout, [reward, error] + ([detail] if detail is not None else []))
    except MemoryError:
      write_frame(stdout, [0.0, MEMORY])


if __name__ == "__main__":
  serve(int(sys.argv[1]) if len(sys.argv) > 1 else 1024)
