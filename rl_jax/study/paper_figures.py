"""One command per paper figure: the project's analogue of a figure of [SC] or [MiniRL], drawn in the paper's layout.

  python -m rl_jax.study.paper_figures                      # lists the figures and the studies behind them
  python -m rl_jax.study.paper_figures sc_fig3 --root ROOT  # ROOT: the study's run root (python -m rl_jax.study)

Layout as in the papers: one panel per mismatch level (the study's panels), one line per method
(its lines), held-out greedy accuracy against the step, the shading a 95% t interval over seeds at
each evaluation (mean +- t(0.975, n - 1) x s.e.; no shading where one seed logged). Only finished
runs are drawn, as in the study's own figure (rl_jax/study/runner.py `groups_of`).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import textwrap

import numpy as np

from rl_jax import cli
from rl_jax.analysis import aggregate
from rl_jax.study import runner, studies

METRIC = "eval_greedy_accuracy"


@dataclasses.dataclass(frozen=True)
class PaperFigure:
  """A paper's figure and the study (and its panels / lines, in drawing order; None: all) that answers it."""
  paper: str
  study: str
  panels: tuple[str, ...] | None = None
  lines: tuple[str, ...] | None = None
  metric: str = METRIC


FIGURES: dict[str, PaperFigure] = {
    "sc_fig1": PaperFigure("[SC] Fig. 1: a quantized sampler (bf16 trainer; FP8, FP4 KV) under PG and SC",
                           "dose_response", panels=("clean", "bf16_fp8", "bf16_fp4kv")),
    "sc_fig2": PaperFigure("[SC] Fig. 2: online vs offline x reward modes", "fig2_online_offline"),
    "sc_fig3": PaperFigure("[SC] Fig. 3: relative weight noise x corrections", "fig3_weight_noise"),
    "sc_fig4": PaperFigure("[SC] Fig. 4: severe quantization and staleness x corrections", "fig4_quant_stale"),
    "sc_fig4_async": PaperFigure("[SC] Fig. 4 (asynchronous systems): async lag K vs emulated staleness, PG and SC",
                                 "async_lag"),
    "sc_fig5": PaperFigure("[SC] Fig. 5: top-k score centering", "fig5_topk_sc"),
    "sc_dose": PaperFigure("[SC] Figs. 1, 3, 4 as one ladder: each mismatch source's dose, PG and SC",
                           "dose_response"),
    "minirl_fig1": PaperFigure("[MiniRL] Fig. 1: on-policy ablations", "minirl_on_policy"),
    "minirl_fig2_4": PaperFigure("[MiniRL] Figs. 2-4: off-policy N x clipping x routing replay", "minirl_off_policy"),
    "sc_contrasts": PaperFigure("[SC] Figs. 1, 4, 5 at 20 paired seeds (issue 37 step 4): PG, TIS, SC, SC + TIS, "
                                "top-4 and full SC under a bf16 trainer + FP8 W/A / FP4 KV sampler", "contrasts",
                                panels=("bf16_fp4kv",), lines=("pg", "tis", "sc", "sc_tis", "sc_top4", "sc_full")),
    "minirl_fig1_contrasts": PaperFigure("[MiniRL] Fig. 1 at 20 paired seeds (issue 37 step 4): on-policy MiniRL, "
                                         "without the IS weight, length-normalized, bf16 trainer + FP8 sampler",
                                         "contrasts", panels=("bf16_fp8",),
                                         lines=("minirl", "minirl_no_is", "minirl_length_norm")),
    "headline": PaperFigure("[SC] Figs. 4-5 and [MiniRL] Figs. 1, 3: the protocol's headline contrasts", "headline"),
}


def _t975(n: np.ndarray) -> np.ndarray:
  from scipy import stats  # the statistics' dependency (rl_jax/study/stats.py)
  out = np.full(n.shape, np.nan)
  ok = n >= 2
  out[ok] = stats.t.ppf(0.975, n[ok] - 1)
  return out


def groups_for(fig: PaperFigure, root: str):
  """The study's finished-run groups under ROOT restricted to the figure's panels and lines, in order."""
  study = studies.get(fig.study)
  if fig.panels:
    study = study.only_panels(list(fig.panels))
  if fig.lines:
    study = study.only_lines(list(fig.lines))
  groups = runner.groups_of(runner.plan(study, root))
  if not groups:
    raise FileNotFoundError(f"study {fig.study!r}: no finished run under {root} (run `python -m rl_jax.study "
                            f"{fig.study} --root {root}` first)")
  return groups


def draw(name: str, root: str, out: str | None = None) -> str:
  """Writes figure `name` (FIGURES) from the runs under ROOT to `out` (default ROOT/paper_<name>.png)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  if name not in FIGURES:
    raise KeyError(f"paper figure {name!r}: known: {', '.join(FIGURES)}")
  fig_def = FIGURES[name]
  groups = groups_for(fig_def, root)
  panels = list(dict.fromkeys(g.panel for g in groups))
  lines = list(dict.fromkeys(g.line for g in groups))
  colors = {ln: plt.get_cmap("tab10")(i % 10) for i, ln in enumerate(lines)}
  # A one-panel figure is wider than its panel (room for the legend and the wrapped title).
  fig, axes = plt.subplots(1, len(panels), figsize=(max(3.6 * len(panels), 6.0), 3.8), squeeze=False, sharey=True)
  for j, panel in enumerate(panels):
    ax = axes[0, j]
    for g in (g for g in groups if g.panel == panel):
      c = aggregate.aggregate_curve(g.runs, fig_def.metric)
      if not c.steps.size:
        continue
      half = np.nan_to_num(_t975(c.n) * c.se)
      ax.plot(c.steps, c.mean, color=colors[g.line], marker="o", ms=2.5, lw=1.2, label=f"{g.line} (n={g.n})")
      ax.fill_between(c.steps, c.mean - half, c.mean + half, color=colors[g.line], alpha=0.18, lw=0)
    ax.set_title(panel, fontsize=10)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
  axes[0, 0].set_ylabel("held-out greedy accuracy")
  axes[0, 0].legend(fontsize=7)
  title = f"{fig_def.paper}  (study `{fig_def.study}`; shading: 95% t interval over seeds)"
  fig.suptitle(textwrap.fill(title, width=int(13 * fig.get_size_inches()[0])), fontsize=9)
  fig.tight_layout()
  out = out or os.path.join(root, f"paper_{name}.png")
  fig.savefig(out, dpi=110)
  plt.close(fig)
  return out


def listing() -> str:
  return "\n".join(f"  {k:<15} study {f.study:<20} {f.paper}" for k, f in FIGURES.items())


@cli.expected_errors("python -m rl_jax.study.paper_figures")
def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="python -m rl_jax.study.paper_figures", description=__doc__.split("\n")[0])
  p.add_argument("figure", nargs="?", default=None, help="a figure name (no name: list them)")
  p.add_argument("--root", default=None, help="the study's run root (the --root it ran with)")
  p.add_argument("--out", default=None, help="output PNG (default ROOT/paper_FIGURE.png)")
  a = p.parse_args(argv)
  if a.figure is None:
    print("paper figures:\n" + listing())
    return 0
  if a.figure not in FIGURES:
    p.error(f"figure {a.figure!r}: known:\n{listing()}")
  if a.root is None:
    p.error(f"--root: the run root of study {FIGURES[a.figure].study!r} is required")
  try:
    print(draw(a.figure, a.root, a.out))
  except FileNotFoundError as e:
    print(f"{p.prog}: error: {e}", file=sys.stderr)
    return cli.CONFIG_ERROR
  return 0


if __name__ == "__main__":
  sys.exit(main())
