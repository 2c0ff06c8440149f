"""Per-run-name table (markdown, CSV, JSON): final / best held-out accuracy, collapse, mean KL, meters."""
from __future__ import annotations

import csv
import json
import math
import os
from typing import Sequence

from rl_jax.analysis.aggregate import GroupSummary


def fmt(t: tuple[float, float, int], digits: int = 3) -> str:
  """'mean +- s.e.' (just the mean when s.e. is undefined, '-' when nothing was logged)."""
  m, se, n = t
  if n == 0 or not math.isfinite(m):
    return "-"
  if not math.isfinite(se):
    return f"{m:.{digits}g}"
  return f"{m:.{digits}g} +- {se:.2g}"


def collapse_text(s: GroupSummary) -> str:
  steps = [c for c in s.collapse_steps if c is not None]
  if not steps:
    return f"0/{len(s.collapse_steps)}"
  return f"{len(steps)}/{len(s.collapse_steps)} (steps {', '.join(str(c) for c in steps)})"


COLUMNS = ("name", "seeds", "final acc", "best acc", "final reward", "collapsed", "mean KL k1")


def _extra_columns(summaries: Sequence[GroupSummary]) -> list[str]:
  return list(dict.fromkeys(k for s in summaries for k in s.extra))


def markdown(summaries: Sequence[GroupSummary]) -> str:
  extra = _extra_columns(summaries)
  head = list(COLUMNS) + [f"mean {k}" for k in extra]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for s in summaries:
    cells = [s.name, str(len(s.seeds)), fmt(s.final_accuracy), fmt(s.best_accuracy), fmt(s.final_reward),
             collapse_text(s), fmt(s.mean_kl)] + [fmt(s.extra[k]) if k in s.extra else "-" for k in extra]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def write_tables(summaries: Sequence[GroupSummary], out_dir: str, stem: str = "table") -> dict[str, str]:
  """Writes OUT/stem.md, .csv and .json; returns their paths by extension."""
  os.makedirs(out_dir, exist_ok=True)
  paths = {ext: os.path.join(out_dir, f"{stem}.{ext}") for ext in ("md", "csv", "json")}
  with open(paths["md"], "w") as f:
    f.write(markdown(summaries))
  extra = _extra_columns(summaries)
  with open(paths["csv"], "w", newline="") as f:
    w = csv.writer(f)
    stats = ["final_accuracy", "best_accuracy", "final_reward", "mean_kl"] + extra
    w.writerow(["name", "panel", "line", "n_seeds", "n_collapsed", "collapse_steps"]
               + [f"{k}_{p}" for k in stats for p in ("mean", "se", "n")])
    for s in summaries:
      vals = [s.final_accuracy, s.best_accuracy, s.final_reward, s.mean_kl] + [
          s.extra.get(k, (math.nan, math.nan, 0)) for k in extra]
      w.writerow([s.name, s.panel, s.line, len(s.seeds), s.n_collapsed,
                  " ".join("-" if c is None else str(c) for c in s.collapse_steps)]
                 + [x for t in vals for x in t])
  with open(paths["json"], "w") as f:
    # nan is not JSON: undefined statistics are null.
    json.dump([_nan_to_none(s.as_dict()) for s in summaries], f, indent=1)
  return paths


def _nan_to_none(x):
  if isinstance(x, float) and not math.isfinite(x):
    return None
  if isinstance(x, dict):
    return {k: _nan_to_none(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_nan_to_none(v) for v in x]
  return x
