"""Preemption: SIGTERM / SIGINT end a job at the next step boundary with a checkpoint and exit code 75."""
from __future__ import annotations

import signal
import threading

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
