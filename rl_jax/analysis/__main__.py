"""Compare CLI: python -m rl_jax.analysis --workdirs 'runs/*/seed*' [--group_by loss.method] --out DIR.

Writes DIR/figure.png (one line per group, mean +- s.e. over seeds) and DIR/table.{md,csv,json}
(final / best held-out accuracy, collapse, mean KL) for any set of RL workdirs. By default runs are
grouped by every config key whose value differs across them (the seed, paths and logging aside;
read from each workdir's stored run.json or the study runner's study.json), so no group pools two
configurations; `--group_by a.b[,c.d]` groups by the named keys instead and is refused when a group
would still pool runs that differ in another key (named), unless `--allow_mixed`.
"""
from __future__ import annotations

import argparse
import sys

from rl_jax import analysis
from rl_jax import cli
from rl_jax.analysis import aggregate, figures


@cli.expected_errors("python -m rl_jax.analysis")
def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="python -m rl_jax.analysis", description=__doc__.split("\n")[0])
  p.add_argument("--workdirs", nargs="+", required=True, help="globs of workdirs (quote them)")
  p.add_argument("--out", required=True, help="output directory")
  p.add_argument("--group_by", default=None,
                 help="config key(s), comma-separated, e.g. loss.method,loss.score_centering (default: "
                      "every key that differs across the runs)")
  p.add_argument("--allow_mixed", action="store_true",
                 help="pool runs that differ in keys --group_by does not name (refused by default)")
  p.add_argument("--panel_by", default=None, help="config key drawn as one panel per value")
  p.add_argument("--collapse_metric", default=aggregate.COLLAPSE_METRIC)
  p.add_argument("--collapse_floor", type=float, default=aggregate.COLLAPSE_FLOOR,
                 help="collapse: an evaluation after --collapse_after at or below this, or an abort")
  p.add_argument("--collapse_after", type=int, default=aggregate.COLLAPSE_AFTER)
  p.add_argument("--smooth", type=int, default=figures.SMOOTH, help="moving-average window (steps)")
  p.add_argument("--title", default=None)
  args = p.parse_args(argv)
  runs = analysis.load_runs(args.workdirs)
  if not runs:
    p.error(f"--workdirs {args.workdirs}: no directory with a metrics.jsonl matched")
  try:
    groups = analysis.group_runs(runs, args.group_by, args.panel_by, allow_mixed=args.allow_mixed)
  except analysis.runs.MixedGroupError as e:
    print(f"{p.prog}: error: {e}", file=sys.stderr)
    return cli.CONFIG_ERROR
  except ValueError as e:  # group_runs' other refusal: a --group_by the runs' stored configs cannot take
    cli.fail(cli.CONFIG_ERROR, f"{p.prog}: error: {e}")
  keys = sorted({k for g in groups for k in g.keys})
  print(f"grouped by: {', '.join(keys) if keys else 'run name'}")
  for g in groups:
    if g.mixed:
      print(f"warning: group {g.name!r} pools runs that differ in {', '.join(g.mixed)} (--allow_mixed)")
  paths, summaries = analysis.compare(groups, args.out, title=args.title, floor=args.collapse_floor,
                                      after=args.collapse_after, collapse_metric=args.collapse_metric,
                                      smooth=args.smooth)
  print(analysis.tables.markdown(summaries))
  print(f"{len(runs)} runs in {len(groups)} groups -> " + ", ".join(paths[k] for k in ("png", "md", "csv", "json")))
  return 0


if __name__ == "__main__":
  sys.exit(main())
