"""End-of-run figure: reward, held-out accuracy, entropy, train/inference KL and the two meters over steps."""
from __future__ import annotations

import math
import os

from etils import epath

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top,wrong-import-position

PANELS = (
    ("Reward (train)", ("reward",)),
    ("Held-out accuracy", ("eval_greedy_accuracy", "eval_sampled_accuracy", "eval_pass_at_k")),
    ("Token entropy of p", ("loss/entropy",)),
    ("Train/inference KL(q || p_old)", ("mismatch/kl_k1", "mismatch/kl_k3")),
    # Logged only when the sampler records its top-k (sampler.record_topk > 0).
    ("Drift: TV(q, p) per token", ("drift/tv_mean", "drift/tv_max")),
    # Logged only under score centering.
    ("Score centering's share of the update", ("drift/sc_share",)),
    # Logged every rl.meter_every steps.
    ("First-order approximation: g_tok vs g_seq", ("first_order/cosine", "first_order/norm_ratio")),
    # Logged every rl.attribution_every steps: one line per mismatch source the run has on.
    ("Mismatch attribution: KL(q_s || p) per source", ("attribution/*/kl",)),
)
COLS = 2


SMOOTH = 9


def moving_average(ys, window: int) -> list[float]:
  """Centered moving average; the window shrinks at the ends instead of padding."""
  half = window // 2
  return [sum(ys[max(0, i - half):i + half + 1]) / len(ys[max(0, i - half):i + half + 1])
          for i in range(len(ys))]


def _expand(keys, rows: list[dict]) -> list[str]:
  """`keys` with each 'a/*/b' replaced by the logged keys it matches, in the order first logged."""
  out = []
  for key in keys:
    if "*" not in key:
      out.append(key)
      continue
    head, tail = key.split("*")
    out.extend(dict.fromkeys(k for r in rows for k in r if k.startswith(head) and k.endswith(tail)
                             and "/" not in k[len(head):len(k) - len(tail)]))
  return out


def _points(rows: list[dict], key: str) -> list[tuple]:
  """(step, value) of every finite number logged under `key`."""
  return [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]


def plot_run(rows: list[dict], path: str | os.PathLike) -> str | os.PathLike:
  """Writes a PNG of the metrics in `rows` (one dict per logged step, one panel per PANELS entry).

  `path` is a str or an `etils.epath.Path` (a gs:// workdir included): written through
  `epath.Path(path).open("wb")`. Only panels with at least one logged point are drawn (a run
  without the meters, attribution or score centering gets no empty axes for them).
  """
  panels = [(title, series) for title, keys in PANELS
            if (series := [(key, pts) for key in _expand(keys, rows) if (pts := _points(rows, key))])]
  panels = panels or [(PANELS[0][0], [])]  # nothing logged yet: one empty axis, still a valid PNG
  n_rows = math.ceil(len(panels) / COLS)
  fig, axes = plt.subplots(n_rows, COLS, figsize=(5 * COLS, 3.5 * n_rows), squeeze=False)
  for ax in axes.ravel()[len(panels):]:
    ax.axis("off")
  for ax, (title, series) in zip(axes.ravel(), panels):
    for key, pts in series:
      xs, ys = zip(*pts)
      dense = len(pts) >= 30
      ax.plot(xs, ys, marker=None if dense else "o", ms=3, label=key, alpha=0.4 if dense else 1.0)
      if dense:  # per-step figures are noisy: overlay a centered moving average (as [SC] plots)
        ax.plot(xs, moving_average(ys, SMOOTH), color=ax.lines[-1].get_color(),
                label=f"{key} (avg {SMOOTH})")
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
      ax.legend(fontsize=8)
  fig.tight_layout()
  with epath.Path(path).open("wb") as f:
    fig.savefig(f, format="png", dpi=100)
  plt.close(fig)
  return path
