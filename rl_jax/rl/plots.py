"""End-of-run figure: reward, held-out accuracy, entropy and train/inference KL over steps."""
from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top,wrong-import-position

PANELS = (
    ("Reward (train)", ("reward",)),
    ("Held-out accuracy", ("eval_greedy_accuracy", "eval_sampled_accuracy", "eval_pass_at_k")),
    ("Token entropy of p", ("loss/entropy",)),
    ("Train/inference KL(q || p_old)", ("mismatch/kl_k1", "mismatch/kl_k3")),
)


SMOOTH = 9


def moving_average(ys, window: int) -> list[float]:
  """Centered moving average; the window shrinks at the ends instead of padding."""
  half = window // 2
  return [sum(ys[max(0, i - half):i + half + 1]) / len(ys[max(0, i - half):i + half + 1])
          for i in range(len(ys))]


def plot_run(rows: list[dict], path: str) -> str:
  """Writes a 2x2 PNG of the metrics in `rows` (one dict per logged step) to `path`."""
  fig, axes = plt.subplots(2, 2, figsize=(10, 7))
  for ax, (title, keys) in zip(axes.ravel(), PANELS):
    for key in keys:
      pts = [(r["step"], r[key]) for r in rows
             if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
      if pts:
        xs, ys = zip(*pts)
        dense = len(pts) >= 30
        ax.plot(xs, ys, marker=None if dense else "o", ms=3, label=key, alpha=0.4 if dense else 1.0)
        if dense:  # per-step figures are noisy: overlay a centered moving average (as 001 plots)
          ax.plot(xs, moving_average(ys, SMOOTH), color=ax.lines[-1].get_color(),
                  label=f"{key} (avg {SMOOTH})")
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
      ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path
