"""Loads run workdirs (metrics.jsonl, summary.json, stored config, study labels) and groups them over seeds.

A workdir is any directory with a `metrics.jsonl` written by the RL trainer. Its run name is
its path without the trailing `seed<k>` component (`ROOT/<name>/seed<k>`), relative to the
common parent of the loaded runs. Its config is read from the run-state file
`<workdir>/run.json` (its "config"), `<workdir>/run/config.json` or `<workdir>/config.json`
when one was stored, and otherwise from the `study.json` that
the study runner writes beside each run (the run's overrides); `config_value` looks in both.

Metric names changed from flat (`kl_k1`) to prefixed (`mismatch/kl_k1`); `METRIC_ALIASES` maps
each canonical name to the names it had, so old and new workdirs are read alike.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import re
from typing import Any, Iterable

# Canonical metric name -> names it is found under, first match wins (new names first).
METRIC_ALIASES: dict[str, tuple[str, ...]] = {
    "mismatch/kl_k1": ("mismatch/kl_k1", "kl_k1"),
    "mismatch/kl_k3": ("mismatch/kl_k3", "kl_k3"),
    "mismatch/prob_diff_mean": ("mismatch/prob_diff_mean", "prob_diff_mean"),
    "mismatch/prob_diff_max": ("mismatch/prob_diff_max", "prob_diff_max"),
    "mismatch/routing_agreement": ("mismatch/routing_agreement", "routing_agreement"),
    "mismatch/head_mass_mean": ("mismatch/head_mass_mean", "sampler_head_mass_mean"),
    "mismatch/head_mass_min": ("mismatch/head_mass_min", "sampler_head_mass_min"),
    "drift/tv_mean": ("drift/tv_mean", "loss/drift/tv_mean", "loss/drift_tv_mean"),
    "drift/tv_max": ("drift/tv_max", "loss/drift/tv_max", "loss/drift_tv_max"),
    "drift/sc_share": ("drift/sc_share", "loss/drift/sc_share", "loss/drift_sc_share"),
    "first_order/cosine": ("first_order/cosine",),
    "first_order/norm_ratio": ("first_order/norm_ratio",),
}

# (file, key holding the config or None for the whole file), first found wins.
CONFIG_FILES = (("run.json", "config"), ("run/config.json", None), ("config.json", None))
STUDY_FILE = "study.json"      # written by rl_jax.study's runner: study, run, panel, line, seed, overrides
FAILED_FILE = "failed.json"    # written by the runner when the job exited non-zero: rc, error
_SEED_DIR = re.compile(r"^seed(\d+)$")


def aliases(metric: str) -> tuple[str, ...]:
  return METRIC_ALIASES.get(metric, (metric,))


def _float(v: Any) -> float | None:
  """A logged value as a float: MetricsWriter stores non-finite values as the strings 'nan' / 'inf'."""
  if isinstance(v, bool) or v is None:
    return None
  if isinstance(v, (int, float)):
    return float(v)
  if isinstance(v, str):
    try:
      return float(v)
    except ValueError:
      return None
  return None


def _read_json(path: str) -> dict | None:
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


@dataclasses.dataclass
class Run:
  """One workdir: its metric rows (one per step, the last write of a step wins), summary and labels."""
  workdir: str
  name: str
  seed: int | None
  rows: list[dict]
  summary: dict | None = None
  config: dict | None = None
  study: dict | None = None
  failed: dict | None = None

  def series(self, metric: str) -> tuple[list[int], list[float]]:
    """(steps, values) of `metric` (any of its aliases) in step order; non-finite values kept as nan."""
    for key in aliases(metric):
      pts = [(r["step"], _float(r[key])) for r in self.rows if key in r]
      pts = [(s, v) for s, v in pts if v is not None]
      if pts:
        return [s for s, _ in pts], [v for _, v in pts]
    return [], []

  def has(self, metric: str) -> bool:
    return any(k in r for r in self.rows for k in aliases(metric))

  @property
  def last_step(self) -> int:
    return max((r["step"] for r in self.rows), default=0)

  @property
  def aborted_step(self) -> int | None:
    """The step a non-finite abort happened at (the trainer raises before logging that step)."""
    if self.failed and "non-finite" in str(self.failed.get("error", "")):
      return self.last_step + 1
    return None

  def config_value(self, key: str) -> Any:
    """A dotted config key from the stored config, else from the study's overrides; None if absent."""
    if self.config is not None:
      node: Any = self.config
      for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
          node = None
          break
        node = node[part]
      if node is not None:
        return node
    if self.study is not None:
      if key in ("panel", "line", "run", "study"):
        return self.study.get(key)
      return self.study.get("overrides", {}).get(key)
    return None


def read_rows(workdir: str) -> list[dict]:
  """metrics.jsonl rows deduplicated by step: a resumed run re-logs the steps after its checkpoint."""
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  by_step: dict[int, dict] = {}
  with open(path) as f:
    for line in f:
      if line.strip():
        row = json.loads(line)
        by_step[int(row["step"])] = row
  return [by_step[s] for s in sorted(by_step)]


def load_run(workdir: str, name: str | None = None) -> Run:
  workdir = os.path.normpath(workdir)
  base = os.path.basename(workdir)
  m = _SEED_DIR.match(base)
  config = None
  for rel, key in CONFIG_FILES:
    config = _read_json(os.path.join(workdir, rel))
    if config is not None and key is not None:
      config = config.get(key)
    if config is not None:
      break
  study = _read_json(os.path.join(workdir, STUDY_FILE))
  seed = int(m.group(1)) if m else None
  if study is not None and study.get("seed") is not None:
    seed = int(study["seed"])
  elif config is not None and "seed" in config:
    seed = int(config["seed"])
  return Run(workdir=workdir, name=name or (os.path.dirname(workdir) if m else workdir), seed=seed,
             rows=read_rows(workdir), summary=_read_json(os.path.join(workdir, "summary.json")),
             config=config, study=study, failed=_read_json(os.path.join(workdir, FAILED_FILE)))


def find_workdirs(patterns: Iterable[str]) -> list[str]:
  """Directories matching the glob `patterns` (recursive `**` allowed) that hold a metrics.jsonl."""
  out = set()
  for p in patterns:
    for d in glob.glob(os.path.expanduser(p), recursive=True):
      if os.path.isfile(os.path.join(d, "metrics.jsonl")):
        out.add(os.path.normpath(d))
  return sorted(out)


def load_runs(patterns: Iterable[str] | str) -> list[Run]:
  """Loads every RL workdir the globs match; names are made relative to their common parent."""
  if isinstance(patterns, str):
    patterns = [patterns]
  # Only RL runs: a `**` glob also reaches SFT workdirs (a study's warm_start), which log neither.
  runs = [r for r in (load_run(d) for d in find_workdirs(patterns))
          if any("reward" in row or "eval_greedy_accuracy" in row for row in r.rows)]
  parents = [os.path.dirname(r.workdir) if _SEED_DIR.match(os.path.basename(r.workdir)) else r.workdir
             for r in runs]
  if len(set(parents)) > 1:
    common = os.path.commonpath(parents)
    for r, p in zip(runs, parents):
      r.name = os.path.relpath(p, common)
  elif runs:
    for r, p in zip(runs, parents):
      r.name = os.path.basename(p)
  for r in runs:
    if r.study is not None and r.study.get("run"):
      r.name = r.study["run"]
  return runs


@dataclasses.dataclass
class Group:
  """Runs of one configuration over seeds, drawn as one line in one panel."""
  name: str
  panel: str
  line: str
  runs: list[Run]

  @property
  def n(self) -> int:
    return len(self.runs)


def _label(v: Any) -> str:
  return "unset" if v is None else (f"{v:g}" if isinstance(v, float) and math.isfinite(v) else str(v))


def group_runs(runs: list[Run], group_by: str | None = None, panel_by: str | None = None) -> list[Group]:
  """Groups runs by name (or by the config key `group_by`), one panel per `panel_by` value.

  Without `panel_by`, runs the study runner labelled keep their study panel and line; other
  runs go into one panel named 'all'. Order: first appearance.
  """
  groups: dict[tuple[str, str], Group] = {}
  for r in runs:
    if group_by:
      line = _label(r.config_value(group_by))
      if r.config is None and r.study is None:
        raise ValueError(f"--group_by {group_by}: {r.workdir} has no stored config (config.json) "
                         "nor study.json; group by run name instead (omit --group_by)")
    elif r.study is not None and r.study.get("line"):
      line = r.study["line"]
    else:
      line = r.name
    if panel_by:
      panel = f"{panel_by}={_label(r.config_value(panel_by))}"
    elif not group_by and r.study is not None and r.study.get("panel"):
      panel = r.study["panel"]
    else:
      panel = "all"
    name = line if panel == "all" else f"{panel}/{line}"
    if (panel, line) not in groups:
      groups[(panel, line)] = Group(name=name, panel=panel, line=line, runs=[])
    groups[(panel, line)].runs.append(r)
  for g in groups.values():
    g.runs.sort(key=lambda r: (r.seed is None, r.seed, r.workdir))
  return list(groups.values())
