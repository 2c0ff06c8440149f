"""Study figure: one column per mismatch regime (panel), one row per metric, one line per method.

Each line is the mean over seeds with +-1 standard-error shading and the number of seeds in
the legend; dense per-step curves are drawn faint with their centered moving average on
top (as [SC] plots), sparse evaluation curves with markers.
"""
from __future__ import annotations

import textwrap
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position

from rl_jax.analysis import aggregate  # pylint: disable=g-import-not-at-top,wrong-import-position
from rl_jax.analysis.runs import Group  # pylint: disable=g-import-not-at-top,wrong-import-position

# (row title, canonical metric); rows no run logged are left out.
METRICS: tuple[tuple[str, str], ...] = (
    ("Held-out greedy accuracy", "eval_greedy_accuracy"),
    ("Held-out sampled accuracy", "eval_sampled_accuracy"),
    ("Train reward", "reward"),
    ("Token entropy", "loss/entropy"),
    ("Train/inference KL k1", "mismatch/kl_k1"),
    ("Drift TV (mean)", "drift/tv_mean"),
    ("First-order cosine", "first_order/cosine"),
)
SMOOTH = 9
DENSE = 30   # curves with at least this many points get the moving average


def _panels(groups: Sequence[Group]) -> list[str]:
  return list(dict.fromkeys(g.panel for g in groups))


def plot_groups(groups: Sequence[Group], path: str, metrics: Sequence[tuple[str, str]] = METRICS,
                smooth: int = SMOOTH, title: str | None = None) -> str:
  """Writes the figure of `groups` to `path` (PNG) and returns it."""
  if not groups:
    raise ValueError("plot_groups: no runs to draw (no metrics.jsonl found?)")
  rows = [(t, m) for t, m in metrics if any(r.has(m) for g in groups for r in g.runs)]
  if not rows:
    raise ValueError(f"plot_groups: none of the metrics {[m for _, m in metrics]} was logged")
  panels = _panels(groups)
  lines = list(dict.fromkeys(g.line for g in groups))
  colors = {ln: plt.get_cmap("tab10")(i % 10) for i, ln in enumerate(lines)}
  fig, axes = plt.subplots(len(rows), len(panels), figsize=(4.2 * len(panels), 2.8 * len(rows)),
                           squeeze=False, sharex="col")
  for j, panel in enumerate(panels):
    for i, (row_title, metric) in enumerate(rows):
      ax = axes[i, j]
      for g in (g for g in groups if g.panel == panel):
        c = aggregate.aggregate_curve(g.runs, metric)
        if not c.steps.size:
          continue
        color = colors[g.line]
        label = f"{g.line} (n={g.n})"
        se = np.where(np.isfinite(c.se), c.se, 0.0)
        if c.steps.size >= DENSE:
          mean = aggregate.moving_average(c.mean, smooth)
          se = aggregate.moving_average(se, smooth)
          ax.plot(c.steps, c.mean, color=color, alpha=0.2, lw=0.8)
          ax.plot(c.steps, mean, color=color, label=label)
        else:
          mean = c.mean
          ax.plot(c.steps, mean, color=color, marker="o", ms=3, label=label)
        ax.fill_between(c.steps, mean - se, mean + se, color=color, alpha=0.2, lw=0)
      if i == 0:
        ax.set_title(panel)
      if j == 0:
        ax.set_ylabel(row_title, fontsize=9)
      if i == len(rows) - 1:
        ax.set_xlabel("step")
      if metric == "mismatch/kl_k1" and ax.lines and all(
          (l.get_ydata() > 0).all() for l in ax.lines if np.size(l.get_ydata())):
        ax.set_yscale("log")
      ax.grid(alpha=0.3)
      if ax.get_legend_handles_labels()[0] and i == 0:
        ax.legend(fontsize=7)
  if title:
    fig.suptitle(textwrap.fill(title, width=max(60, 50 * len(panels))), fontsize=9)
  # Leave room for a (wrapped) title above the top row.
  fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / (2.8 * len(rows))) if title else None)
  fig.savefig(path, dpi=80)
  plt.close(fig)
  return path
