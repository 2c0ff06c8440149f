"""The dose-response figure and table of a ladder study: accuracy and collapse rate against each mismatch dose.

Reads a protocol study's per_seed.json (panels `clean` and `<source>_<dose>`, e.g. async_4, noise_0.2,
bf16_fp8, stale_16; lines such as `pg`, `sc`) and draws one column per source: the top row is the mean
held-out greedy accuracy over the ladder's window (the rule's last 3 evaluations) with a 95% t
interval over seeds, the bottom row the share of seeds that collapsed (the project's one definition,
the protocol's collapse endpoint: an evaluation after step 20 at or below 0.005, or an abort;
`rl_jax.analysis.aggregate.collapse_step`). The clean arm is drawn at dose 0 of every source.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Sequence

import numpy as np

from rl_jax.analysis import aggregate
from rl_jax.study import rules
from rl_jax.study.protocol import RunScore

CLEAN = "clean"
# A source's doses in drawing order when they are not numbers (the quantized samplers: by bits).
NAMED_DOSES = {"bf16": ("fp8", "fp4kv")}
SOURCE_TITLES = {"async": "async lag K (steps)", "noise": "relative weight noise", "stale": "staleness (steps)",
                 "bf16": "bf16 trainer, quantized sampler"}


@dataclasses.dataclass(frozen=True)
class Cell:
  """One (source, dose, line): per-seed window means and collapse flags."""
  source: str
  dose: str
  line: str
  window_means: tuple[float, ...]
  collapsed: tuple[bool, ...]

  @property
  def n(self) -> int:
    return len(self.window_means)


def _t95(n: int) -> float:
  """Two-sided 95% Student t quantile for n - 1 degrees of freedom (n >= 2)."""
  from scipy import stats  # scipy is a dependency of the statistics already (rl_jax/study/stats.py)
  return float(stats.t.ppf(0.975, n - 1))


def mean_ci(values: Sequence[float]) -> tuple[float, float]:
  """(mean, half-width of the 95% t interval); half-width nan for one value."""
  v = np.asarray(values, dtype=np.float64)
  if v.size < 2:
    return float(v.mean()) if v.size else math.nan, math.nan
  return float(v.mean()), _t95(v.size) * float(v.std(ddof=1)) / math.sqrt(v.size)


def _split(panel: str) -> tuple[str, str]:
  source, _, dose = panel.rpartition("_")
  return (source, dose) if source else (panel, "")


def cells(per_seed: Sequence[dict]) -> list[Cell]:
  """The ladder's cells from per_seed rows (their `evals` lists), read over the rule's window."""
  fields = {f.name for f in dataclasses.fields(RunScore)}
  scores = [RunScore(**{k: (tuple(map(tuple, v)) if k == "evals" else v) for k, v in row.items() if k in fields})
            for row in per_seed]
  window = rules.ladder_window(scores)
  out: dict[tuple[str, str, str], list] = {}
  for s in scores:
    ev = dict(s.evals)
    wm = rules.window_mean(s, window)
    if wm is None:
      continue
    steps = sorted(ev)
    collapsed = aggregate.collapse_step(steps, [ev[k] for k in steps], aborted_step=s.aborted_step) is not None
    source, dose = (CLEAN, "0") if s.panel == CLEAN else _split(s.panel)
    out.setdefault((source, dose, s.line), []).append((wm, collapsed))
  return [Cell(src, dose, line, tuple(x[0] for x in v), tuple(x[1] for x in v))
          for (src, dose, line), v in sorted(out.items())]


def _dose_x(source: str, dose: str) -> float:
  if dose == "0":
    return 0.0
  if source in NAMED_DOSES:
    return 1.0 + NAMED_DOSES[source].index(dose)
  return float(dose)


def markdown(cs: Sequence[Cell]) -> str:
  """One row per (source, dose): each line's window mean [95% CI] and collapse counts."""
  lines = sorted({c.line for c in cs})
  by = {(c.source, c.dose, c.line): c for c in cs}
  head = ("| source | dose | " + " | ".join(f"{ln} window mean [95% CI] | {ln} collapsed"
                                            for ln in lines) + " |")
  rows = [head, "|" + "---|" * (2 + 2 * len(lines))]
  keys = sorted({(c.source, c.dose) for c in cs}, key=lambda k: (k[0] != CLEAN, k[0], _dose_x(*k)))
  for src, dose in keys:
    parts = []
    for ln in lines:
      c = by.get((src, dose, ln))
      if c is None:
        parts += ["-", "-"]
        continue
      m, h = mean_ci(c.window_means)
      parts += [f"{m:.3f} [{m - h:.3f}, {m + h:.3f}]", f"{sum(c.collapsed)}/{c.n}"]
    rows.append(f"| {src} | {dose} | " + " | ".join(parts) + " |")
  return "\n".join(rows) + "\n"


def plot(cs: Sequence[Cell], path: str, title: str = "") -> str:
  """Writes the two-row dose-response figure to `path`; returns it."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  sources = sorted({c.source for c in cs if c.source != CLEAN})
  lines = sorted({c.line for c in cs})
  fig, axes = plt.subplots(2, len(sources), figsize=(3.6 * len(sources), 6.2), squeeze=False, sharey="row")
  colors = {ln: f"C{i}" for i, ln in enumerate(lines)}
  for j, src in enumerate(sources):
    for ln in lines:
      pts = sorted([c for c in cs if c.line == ln and c.source in (src, CLEAN)], key=lambda c: _dose_x(src, c.dose))
      if not pts:
        continue
      x = np.array([_dose_x(src, c.dose) for c in pts])
      m, h = zip(*(mean_ci(c.window_means) for c in pts))
      m, h = np.array(m), np.nan_to_num(np.array(h))
      axes[0, j].plot(x, m, "o-", color=colors[ln], label=ln)
      axes[0, j].fill_between(x, m - h, m + h, color=colors[ln], alpha=0.2)
      axes[1, j].plot(x, [sum(c.collapsed) / c.n for c in pts], "o-", color=colors[ln], label=f"{ln} collapsed")
    axes[1, j].set_xlabel(SOURCE_TITLES.get(src, src))
    if src in NAMED_DOSES:
      for ax in axes[:, j]:
        ax.set_xticks([0, *range(1, 1 + len(NAMED_DOSES[src]))], ["clean", *NAMED_DOSES[src]])
  axes[0, 0].set_ylabel("held-out greedy accuracy\n(window mean, 95% CI)")
  axes[1, 0].set_ylabel(f"share of seeds collapsed\n(eval <= {rules.COLLAPSE_FLOOR:g} after step "
                        f"{aggregate.COLLAPSE_AFTER}, or abort)")
  axes[1, 0].set_ylim(-0.05, 1.05)
  axes[0, 0].legend(fontsize=8)
  axes[1, 0].legend(fontsize=7)
  for ax in axes.flat:
    ax.grid(alpha=0.3)
  if title:
    fig.suptitle(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def write(root: str, title: str = "") -> dict[str, str]:
  """ROOT/per_seed.json -> ROOT/dose_response.png and ROOT/dose_response.md; returns the paths."""
  src = os.path.join(root, "per_seed.json")
  if not os.path.exists(src):
    raise FileNotFoundError(f"{src}: no per-seed table (aggregate the study first)")
  with open(src) as f:
    cs = cells(json.load(f))
  md = os.path.join(root, "dose_response.md")
  with open(md, "w") as f:
    f.write(markdown(cs))
  return {"png": plot(cs, os.path.join(root, "dose_response.png"), title), "md": md}
