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

from rl_jax import artifacts

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
CONFIG_FILES = ((artifacts.RUN, "config"), ("run/config.json", None), ("config.json", None))
STUDY_FILE = artifacts.STUDY
FAILED_FILE = artifacts.FAILED
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


_read_json = artifacts.read_json


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
    if artifacts.aborted_non_finite(self.failed):
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
  path = os.path.join(workdir, artifacts.METRICS)
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
             rows=read_rows(workdir), summary=_read_json(os.path.join(workdir, artifacts.SUMMARY)),
             config=config, study=study, failed=_read_json(os.path.join(workdir, FAILED_FILE)))


def find_workdirs(patterns: Iterable[str]) -> list[str]:
  """Directories matching the glob `patterns` (recursive `**` allowed) that hold a metrics.jsonl."""
  out = set()
  for p in patterns:
    for d in glob.glob(os.path.expanduser(p), recursive=True):
      if os.path.isfile(os.path.join(d, artifacts.METRICS)):
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
  """Runs of one configuration over seeds, drawn as one line in one panel.

  `keys`: the config values that define the group (the grouping keys); `mixed`: other config keys
  whose values differ between its runs (empty unless merged on purpose, `allow_mixed`)."""
  name: str
  panel: str
  line: str
  runs: list[Run]
  keys: dict[str, Any] = dataclasses.field(default_factory=dict)
  mixed: list[str] = dataclasses.field(default_factory=list)

  @property
  def n(self) -> int:
    return len(self.runs)


# Config keys that never tell two runs' treatments apart: the replicate (seed), where a run reads its
# warm start from and writes or logs to, and the resume policy.
NOT_A_TREATMENT = frozenset({"seed", "warm_start.path", "resume"})
NOT_A_TREATMENT_PREFIXES = ("logging.",)


class MixedGroupError(ValueError):
  """A grouping would pool runs whose configs differ in keys it does not group by."""


def flat_config(run: Run) -> dict[str, Any] | None:
  """The run's config as {'a.b': value}: the stored config, else the study runner's overrides."""
  from rl_jax.workdir import flatten  # pylint: disable=g-import-not-at-top
  if run.config is not None:
    return flatten(run.config)
  if run.study is not None and run.study.get("overrides") is not None:
    out = {}
    for k, v in run.study["overrides"].items():   # dotted keys; a dict value is a whole section
      out.update(flatten(v, f"{k}.") if isinstance(v, dict) else {k: v})
    return out
  return None


def _treatment(key: str) -> bool:
  return key not in NOT_A_TREATMENT and not key.startswith(NOT_A_TREATMENT_PREFIXES)


def differing_keys(runs: Iterable[Run], exclude: Iterable[str] = ()) -> list[str]:
  """Treatment keys (not the seed, paths, logging) whose values differ between `runs`, sorted; a key
  one run lacks counts as differing. Runs without a config are ignored."""
  configs = [c for c in (flat_config(r) for r in runs) if c is not None]
  exclude = set(exclude)
  keys = set().union(*configs) if configs else set()
  out = []
  for k in sorted(keys):
    if k in exclude or not _treatment(k):
      continue
    vals = {json.dumps(c[k] if k in c else "<absent>", sort_keys=True, default=str) for c in configs}
    if len(vals) > 1:
      out.append(k)
  return out


def _label(v: Any) -> str:
  return "unset" if v is None else (f"{v:g}" if isinstance(v, float) and math.isfinite(v) else str(v))


def group_runs(runs: list[Run], group_by: str | None = None, panel_by: str | None = None,
               allow_mixed: bool = False) -> list[Group]:
  """Groups runs over seeds; one panel per `panel_by` value.

  `group_by`: a config key or comma-separated keys. Default: the treatment keys whose values differ
  across `runs` (`differing_keys`: not the seed, paths or logging), so that no group pools runs of
  different configurations; with no stored configs, the run name. A group whose runs still differ
  in a key it is not grouped by is refused (`MixedGroupError`, naming the keys) unless
  `allow_mixed`, which keeps it and lists the keys in `Group.mixed`.

  Labels: runs the study runner labelled keep their study panel and line when the group is exactly
  one study cell; otherwise the line is the value of a single `group_by` key, or 'key=value, ...'
  of the grouping keys; the panel is 'all'.
  Order: first appearance.
  """
  panel_keys = [panel_by] if panel_by else []
  if group_by:
    keys = [k for k in group_by.split(",") if k]
    for r in runs:
      if r.config is None and r.study is None:
        raise ValueError(f"--group_by {group_by}: {r.workdir} has no stored config (config.json) "
                         "nor study.json; group by run name instead (omit --group_by)")
  elif all(flat_config(r) is not None for r in runs):
    keys = differing_keys(runs, exclude=panel_keys)
  else:
    keys = None   # no configs to compare: the run name
  groups: dict[tuple, Group] = {}
  for r in runs:
    values = {k: r.config_value(k) for k in keys} if keys is not None else {}
    ident = tuple(json.dumps(values.get(k), sort_keys=True, default=str) for k in keys) if keys else (r.name,)
    panel = f"{panel_by}={_label(r.config_value(panel_by))}" if panel_by else "all"
    key = (panel, ident)
    if key not in groups:
      if group_by and len(keys) == 1:   # the key is the user's own word: its value names the line
        line = _label(values[keys[0]])
      else:
        line = ", ".join(f"{k}={_label(v)}" for k, v in values.items()) if keys else r.name
      groups[key] = Group(name="", panel=panel, line=line or r.name, runs=[], keys=values)
    groups[key].runs.append(r)
  out = []
  for g in groups.values():
    g.runs.sort(key=lambda r: (r.seed is None, r.seed, r.workdir))
    cells = {((r.study or {}).get("panel"), (r.study or {}).get("line")) for r in g.runs}
    cell_panel, cell_line = next(iter(cells)) if len(cells) == 1 else (None, None)
    if not panel_by and cell_line:   # exactly one study cell: its labels
      g.panel, g.line = cell_panel or "all", cell_line
    g.name = g.line if g.panel == "all" else f"{g.panel}/{g.line}"
    g.mixed = differing_keys(g.runs, exclude=(keys or []) + panel_keys) if keys is not None else []
    out.append(g)
  bad = [g for g in out if g.mixed]
  if bad and not allow_mixed:
    detail = "; ".join(f"group {g.name!r} pools runs differing in {', '.join(g.mixed)}" for g in bad)
    raise MixedGroupError(f"{detail}. Group by those keys too (e.g. --group_by "
                          f"{','.join(dict.fromkeys((keys or []) + bad[0].mixed))}), or pass --allow_mixed "
                          "to pool them anyway")
  return out
