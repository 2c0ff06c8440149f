"""Metrics to a JSONL file and to wandb (offline by default); only process 0 writes."""
from __future__ import annotations

import dataclasses
import json
import math
import netrc
import os
import urllib.parse
import warnings
from typing import Any, Literal, Mapping

import jax
import numpy as np

from rl_jax import artifacts
from rl_jax import workdir as wd

METRICS_NAME = artifacts.METRICS
_KEEP_ALL = object()  # MetricsWriter(restored_step=...) default: leave an existing file as it is


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
  """Where metrics go. `wandb_mode='offline'` needs no login; 'disabled' turns wandb off.

  'online' without credentials (no WANDB_API_KEY, no netrc entry for the wandb host) falls back
  to 'offline' with a warning rather than failing after minutes of compute (`wandb sync` later).
  """
  wandb_mode: Literal["offline", "online", "disabled"] = "offline"
  wandb_project: str = "rl_jax"
  run_name: str = ""


def _scalar(v: Any) -> Any:
  if isinstance(v, (str, bool, int)) or v is None:
    return v
  v = float(np.asarray(v))
  return v if math.isfinite(v) else str(v)


def has_wandb_credentials(environ: Mapping[str, str] | None = None) -> bool:
  """WANDB_API_KEY set, or a netrc entry for the wandb host (what `wandb login` writes)."""
  env = os.environ if environ is None else environ
  if env.get("WANDB_API_KEY"):
    return True
  host = urllib.parse.urlparse(env.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
  path = env.get("NETRC") or os.path.join(env.get("HOME", os.path.expanduser("~")), ".netrc")
  try:
    return bool(host) and netrc.netrc(path).authenticators(host) is not None
  except (FileNotFoundError, netrc.NetrcParseError, OSError):
    return False


def resolve_wandb_mode(mode: str, environ: Mapping[str, str] | None = None) -> str:
  """The wandb mode to use: `WANDB_MODE` overrides the config; 'online' without credentials -> 'offline'."""
  env = os.environ if environ is None else environ
  mode = env.get("WANDB_MODE", mode)
  if mode not in ("offline", "online", "disabled"):
    raise ValueError(f"config key 'logging.wandb_mode' (or WANDB_MODE): {mode!r} is not one of "
                     "['offline', 'online', 'disabled']")
  if mode == "online" and not has_wandb_credentials(env):
    warnings.warn("logging.wandb_mode='online' but no wandb credentials (WANDB_API_KEY or a netrc "
                  "entry from `wandb login`): logging offline instead; `wandb sync` the run later")
    return "offline"
  return mode


def truncate_metrics(workdir: Any, restored_step: int | None) -> int:
  """Keeps the `workdir/metrics.jsonl` rows with step <= `restored_step` (none if None), atomically; returns rows dropped.

  A torn last line (a kill mid-write) is dropped too. The file is rewritten to a temporary sibling
  and renamed over the original, so a kill during truncation leaves the old or the new file whole.
  """
  path = wd.as_path(workdir) / METRICS_NAME
  if not path.exists():
    return 0
  lines = [l for l in path.read_text().splitlines() if l.strip()]
  keep = []
  for line in lines:
    try:
      row = json.loads(line)
    except json.JSONDecodeError:
      continue
    if restored_step is not None and int(row.get("step", -1)) <= restored_step:
      keep.append(line)
  if len(keep) != len(lines):
    wd.write_atomic(path, "".join(l + "\n" for l in keep))
  return len(lines) - len(keep)


class MetricsWriter:
  """Appends one JSON object per step to `workdir/metrics.jsonl`, mirrors to wandb.

  Resume: pass `restored_step` (the checkpoint step restored, None for a fresh run) and the rows
  after it (from a killed attempt) are dropped first, so each step appears once. wandb cannot
  delete history: with `run_id` (from the run's stored identity) the wandb run is resumed
  (resume='allow'); wandb ignores a log at a step below the highest it has seen, so steps between
  the restored checkpoint and the kill keep the killed attempt's values there (each still once),
  and the JSONL is the record to trust. Without `run_id`: the identity in `<workdir>/run.json`
  (see rl_jax.workdir.RunDir), else a hash of the path (legacy, for callers without a RunDir).
  Local files are appended to; remote ones (gs://, ...) have no append, so the whole file is
  rewritten per write (small: one line per step).
  """

  def __init__(self, workdir: Any, cfg: LoggingConfig, config_dict: dict | None = None, *,
               run_id: str | None = None, restored_step: Any = _KEEP_ALL):
    self.is_main = jax.process_index() == 0
    self.root = wd.as_path(workdir)
    self.path = self.root / METRICS_NAME
    self._wandb = None
    self._rows: list[str] | None = None
    if not self.is_main:
      return
    self.root.mkdir(parents=True, exist_ok=True)
    if restored_step is not _KEEP_ALL:
      dropped = truncate_metrics(self.root, restored_step)
      if dropped:
        print(f"[metrics] dropped {dropped} row(s) after step {restored_step} from {self.path}")
    if not wd.is_local(self.path):
      self._rows = self.path.read_text().splitlines(keepends=True) if self.path.exists() else []
    mode = resolve_wandb_mode(cfg.wandb_mode)
    if mode != "disabled":
      import wandb  # pylint: disable=g-import-not-at-top
      # wandb writes its own files locally; for a remote workdir they go to ./wandb.
      wandb_dir = os.fspath(self.root) if wd.is_local(self.root) else None
      self._wandb = wandb.init(project=cfg.wandb_project, name=cfg.run_name or None, dir=wandb_dir,
                               mode=mode, config=config_dict, resume="allow",
                               id=run_id or _stored_run_id(self.root) or _legacy_run_id(self.root))

  def write(self, step: int, metrics: dict[str, Any]) -> None:
    if not self.is_main:
      return
    row = {"step": int(step), **{k: _scalar(v) for k, v in metrics.items()}}
    line = json.dumps(row) + "\n"
    if self._rows is None:
      with self.path.open("a") as f:
        f.write(line)
    else:
      self._rows.append(line)
      self.path.write_text("".join(self._rows))
    if self._wandb is not None:
      self._wandb.log({k: v for k, v in row.items() if isinstance(v, (int, float))}, step=int(step))

  def close(self) -> None:
    if self._wandb is not None:
      self._wandb.finish()
      self._wandb = None


def _stored_run_id(root) -> str | None:
  run_file = root / wd.RUN_NAME
  if not run_file.exists():
    return None
  try:
    return (json.loads(run_file.read_text()).get("identity") or {}).get("run_id")
  except json.JSONDecodeError:
    return None


def _legacy_run_id(root) -> str:
  import hashlib  # pylint: disable=g-import-not-at-top
  return hashlib.sha1(os.fspath(root).encode()).hexdigest()[:16]


def read_metrics(workdir: Any) -> list[dict]:
  path = wd.as_path(workdir) / METRICS_NAME
  if not path.exists():
    return []
  return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
