"""Run analysis: load workdirs, aggregate over seeds, study figures and tables (`compare` does all)."""
from __future__ import annotations

import os
from typing import Sequence

from rl_jax.analysis import aggregate, figures, tables
from rl_jax.analysis.runs import Group, Run, group_runs, load_runs


def compare(groups: Sequence[Group], out_dir: str, title: str | None = None,
            floor: float = aggregate.COLLAPSE_FLOOR, after: int = aggregate.COLLAPSE_AFTER,
            collapse_metric: str = aggregate.COLLAPSE_METRIC, smooth: int = figures.SMOOTH
            ) -> tuple[dict[str, str], list[aggregate.GroupSummary]]:
  """Writes OUT/figure.png and OUT/table.{md,csv,json} for `groups` (and OUT/attribution.{png,md} when
  runs logged `attribution/*`); returns the paths and the rows."""
  os.makedirs(out_dir, exist_ok=True)
  summaries = [aggregate.summarize_group(g, collapse_metric=collapse_metric, floor=floor, after=after)
               for g in groups]
  paths = tables.write_tables(summaries, out_dir)
  paths["png"] = figures.plot_groups(groups, os.path.join(out_dir, "figure.png"), smooth=smooth, title=title)
  # Imported here: `python -m rl_jax.analysis.attribution_report` must find it unimported by the package.
  from rl_jax.analysis import attribution_report  # pylint: disable=g-import-not-at-top
  if any(attribution_report.run_sources(r) for g in groups for r in g.runs):
    paths["attribution_png"] = attribution_report.plot(groups, os.path.join(out_dir, "attribution.png"))
    paths["attribution_md"] = os.path.join(out_dir, "attribution.md")
    with open(paths["attribution_md"], "w") as f:
      f.write(attribution_report.markdown(groups) + "\n")
  return paths, summaries


__all__ = ["Group", "Run", "aggregate", "compare", "figures", "group_runs", "load_runs", "tables"]
