"""Mismatch attribution over runs: per source its mean KL / TV per run, a table and a bar figure per group.

Reads the `attribution/<source>/<stat>` rows the trainer logs every `rl.attribution_every` steps
(docs/math.md#mismatch-attribution). A run's figure is the mean over its logged steps; a group's
is the mean over its runs with the standard error across them (seeds).

  python -m rl_jax.analysis.attribution_report --workdirs 'ROOT/*/*/seed*' --out DIR [--stat kl]
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position

from rl_jax import cli  # pylint: disable=g-import-not-at-top,wrong-import-position
from rl_jax.analysis import aggregate  # pylint: disable=g-import-not-at-top,wrong-import-position
from rl_jax.analysis.runs import Group, Run, group_runs, load_runs  # pylint: disable=g-import-not-at-top,wrong-import-position

STATS = ("kl", "tv", "k1", "k3")
# Columns drawn after the sources, in this order; `routing` only for MoE runs.
SUMMARY = ("sum", "interaction", "routing", "total")
# The sources in the order of the sampler's pipeline (a source not listed goes after them).
SOURCES = ("weights", "activations", "kv", "dtype", "noise", "staleness")


def run_sources(run: Run) -> list[str]:
  """The sources a run attributed (`attribution/<source>/kl` logged), the summary columns last."""
  found = dict.fromkeys(k.split("/")[1] for r in run.rows for k in r
                        if k.startswith("attribution/") and k.endswith("/kl"))
  rank = lambda s: SOURCES.index(s) if s in SOURCES else len(SOURCES)
  return sorted((s for s in found if s not in SUMMARY), key=rank) + [s for s in SUMMARY if s in found]


def run_means(run: Run, stat: str = "kl") -> dict[str, float]:
  """Per source, the mean of `attribution/<source>/<stat>` over the run's logged steps."""
  out = {}
  for src in run_sources(run):
    _, ys = run.series(f"attribution/{src}/{stat}")
    ys = [y for y in ys if math.isfinite(y)]
    if ys:
      out[src] = float(np.mean(ys))
  return out


def group_table(groups: Sequence[Group], stat: str = "kl") -> tuple[list[str], list[dict]]:
  """(columns, rows): per group its label, run count and per source (mean, s.e., n) over its runs."""
  cols: list[str] = []
  rows = []
  for g in groups:
    means = [run_means(r, stat) for r in g.runs]
    srcs = list(dict.fromkeys(s for m in means for s in m))
    cols.extend(s for s in srcs if s not in cols)
    rows.append(dict(panel=g.panel, line=g.line,
                     values={s: aggregate.mean_se([m[s] for m in means if s in m]) for s in srcs}))
  rank = lambda s: SOURCES.index(s) if s in SOURCES else len(SOURCES)
  ordered = sorted((c for c in cols if c not in SUMMARY), key=rank) + [c for c in SUMMARY if c in cols]
  return ordered, rows


def markdown(groups: Sequence[Group], stat: str = "kl") -> str:
  """The group table as markdown: mean +- s.e. (n runs) per source."""
  cols, rows = group_table(groups, stat)
  head = "| panel | line | " + " | ".join(cols) + " |"
  out = [head, "|" + "---|" * (len(cols) + 2)]
  for r in rows:
    cells = []
    for c in cols:
      if c not in r["values"]:
        cells.append("-")
        continue
      m, se, n = r["values"][c]
      cells.append(f"{m:.3g} +- {se:.2g} ({n})" if n > 1 else f"{m:.3g} (1)")
    out.append(f"| {r['panel']} | {r['line']} | " + " | ".join(cells) + " |")
  return "\n".join(out)


def plot(groups: Sequence[Group], path: str, stat: str = "kl") -> str:
  """One bar group per run group, one bar per source (mean over runs, +-1 s.e.); log scale."""
  cols, rows = group_table(groups, stat)
  if not rows or not cols:
    raise ValueError("attribution_report.plot: no run logged attribution/* (rl.attribution_every = 0?)")
  fig, ax = plt.subplots(figsize=(max(7.0, len(rows) * (len(cols) + 1) * 0.4), 4.2))
  width = 0.8 / len(cols)
  x = np.arange(len(rows))
  for j, c in enumerate(cols):
    vals = [r["values"].get(c, (np.nan, 0.0, 0)) for r in rows]
    # A log axis takes magnitudes: interaction and k1 may be negative, drawn by |value|.
    ax.bar(x + (j - (len(cols) - 1) / 2) * width, [abs(v[0]) for v in vals], width,
           yerr=[v[1] for v in vals], label=c, hatch="//" if c in SUMMARY else None, alpha=0.85)
  ax.set_xticks(x, [f"{r['panel']}\n{r['line']}" if r["panel"] != "all" else r["line"] for r in rows],
                fontsize=7)
  ax.set_yscale("log")
  ax.set_ylabel(f"|{stat}| per token")
  ax.set_title(f"Mismatch attribution: {stat}(q_s, p) per source (hatched: sum, interaction, routing, "
               "total)", fontsize=9)
  ax.legend(fontsize=7, ncol=min(len(cols), 6), loc="upper center", bbox_to_anchor=(0.5, -0.12))
  ax.grid(alpha=0.3, axis="y")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path


@cli.expected_errors("python -m rl_jax.analysis.attribution_report")
def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="python -m rl_jax.analysis.attribution_report", description=__doc__.split("\n")[0])
  p.add_argument("--workdirs", nargs="+", required=True, help="globs of workdirs (quote them)")
  p.add_argument("--out", required=True, help="output directory: attribution.png and attribution.md")
  p.add_argument("--stat", default="kl", choices=STATS)
  p.add_argument("--group_by", default=None, help="config key(s), comma-separated (default: the differing keys)")
  args = p.parse_args(argv)
  runs = [r for r in load_runs(args.workdirs) if run_sources(r)]
  if not runs:
    print(f"{p.prog}: error: --workdirs {args.workdirs}: no run logged attribution/* "
          "(set rl.attribution_every)", file=sys.stderr)
    return cli.CONFIG_ERROR
  groups = group_runs(runs, args.group_by, allow_mixed=True)
  os.makedirs(args.out, exist_ok=True)
  md = markdown(groups, args.stat)
  with open(os.path.join(args.out, "attribution.md"), "w") as f:
    f.write(md + "\n")
  png = plot(groups, os.path.join(args.out, "attribution.png"), args.stat)
  print(md)
  print(f"{len(runs)} runs in {len(groups)} groups -> {png}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
