"""Run artifacts: the names of the files a run's workdir holds, reading them, and what an exit code says."""
from __future__ import annotations

import json
import os
from typing import Any

METRICS = "metrics.jsonl"   # one JSON row per logged step (rl_jax.metrics.MetricsWriter)
SUMMARY = "summary.json"    # written last, when a job reached its steps (the trainer, SFT)
RUN = "run.json"            # the run's identity and stored config (rl_jax.workdir.RunDir)
STUDY = "study.json"        # the study runner's labels of a run: study, run, panel, line, seed, overrides
FAILED = "failed.json"      # the study runner's record of a non-zero exit: rc, reason, log tail

# Exit codes of `python -m rl_jax.main` (README, launch/README.md): 0 done; 2 a config / usage error
# (nothing ran, or the run refused to start); 3 a run error: a non-finite step stopped it (the last
# good checkpoint stays); 75 preempted (checkpointed on SIGTERM / SIGINT: rerun to resume,
# `rl_jax.preempt`). Anything else is a crash.
CONFIG_ERROR, RUN_ERROR = 2, 3
NON_FINITE = "non_finite"   # `failed.json`'s reason for a RUN_ERROR exit


def read_json(path: Any) -> dict | None:
  """The JSON object at `path` (a str or an epath.Path), or None when there is no such file."""
  if hasattr(path, "read_text"):
    return json.loads(path.read_text()) if path.exists() else None
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def failure_reason(rc: int) -> str:
  """`failed.json`'s reason for exit code `rc`."""
  return NON_FINITE if rc == RUN_ERROR else "config" if rc == CONFIG_ERROR else "crash"


def aborted_non_finite(failed: dict | None) -> bool:
  """Whether a `failed.json` records a run stopped by a non-finite step (its exit code; records
  written before the reason was stored are read by the trainer's message)."""
  if not failed:
    return False
  if "reason" in failed:
    return failed["reason"] == NON_FINITE
  return "non-finite" in str(failed.get("error", ""))
