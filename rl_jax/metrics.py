"""Metrics to a JSONL file and to wandb (offline by default); only process 0 writes."""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Literal

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
  """Where metrics go. `wandb_mode='offline'` needs no login; 'disabled' turns wandb off."""
  wandb_mode: Literal["offline", "online", "disabled"] = "offline"
  wandb_project: str = "rl_jax"
  run_name: str = ""


def _scalar(v: Any) -> Any:
  if isinstance(v, (str, bool, int)) or v is None:
    return v
  v = float(np.asarray(v))
  return v if math.isfinite(v) else str(v)


class MetricsWriter:
  """Appends one JSON object per step to `workdir/metrics.jsonl`, mirrors to wandb."""

  def __init__(self, workdir: str, cfg: LoggingConfig, config_dict: dict | None = None):
    self.is_main = jax.process_index() == 0
    self.path = os.path.join(workdir, "metrics.jsonl")
    self._wandb = None
    if not self.is_main:
      return
    os.makedirs(workdir, exist_ok=True)
    mode = os.environ.get("WANDB_MODE", cfg.wandb_mode)
    if mode != "disabled":
      import wandb  # pylint: disable=g-import-not-at-top
      self._wandb = wandb.init(project=cfg.wandb_project, name=cfg.run_name or None, dir=workdir,
                               mode=mode, config=config_dict, resume="allow",
                               id=_run_id(workdir))

  def write(self, step: int, metrics: dict[str, Any]) -> None:
    if not self.is_main:
      return
    row = {"step": int(step), **{k: _scalar(v) for k, v in metrics.items()}}
    with open(self.path, "a") as f:
      f.write(json.dumps(row) + "\n")
    if self._wandb is not None:
      self._wandb.log({k: v for k, v in row.items() if isinstance(v, (int, float))}, step=int(step))

  def close(self) -> None:
    if self._wandb is not None:
      self._wandb.finish()
      self._wandb = None


def _run_id(workdir: str) -> str:
  """A stable wandb run id per workdir, so a resumed job continues the same run."""
  import hashlib  # pylint: disable=g-import-not-at-top
  return hashlib.sha1(os.path.abspath(workdir).encode()).hexdigest()[:16]


def read_metrics(workdir: str) -> list[dict]:
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]
