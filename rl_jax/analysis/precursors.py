"""Do the meters warn before a collapse? Per run, when a meter crosses a multiple of its baseline; over runs, an ROC per meter.

For one run and one meter:
  baseline = median of the meter's values logged at steps < `baseline_steps` (the run's start,
             before the policy has moved far from its warm start); a meter first read later
             (every `rl.meter_every` >= baseline_steps steps) takes its first reading;
  alarm    = the first later step at which the meter crosses `factor` x baseline: upward for the
             drift meter (`drift/tv_mean`, which grows as trainer and sampler part), downward for the
             first-order cosine (`first_order/cosine`, which falls as the token-level objective stops
             approximating the sequence-level one). A baseline <= 0 gives no alarm (nothing to scale).
Against the run's accuracy collapse (`aggregate.run_collapse`: the project's one definition, an
evaluation after step 20 at or below 0.005 or an abort; until issue 53 it was two evaluations below
half the running best, and the exploratory studies' tables were computed under that), an alarm is a *warning* when it comes
at or before the collapse step, *late* when after it, and a *false alarm* in a run that never
collapsed. Lead = collapse step - alarm step (>= 0 for a warning). These definitions are fixed here,
before they were applied to any study.

The first-order meter reports cosine 0 *and* norm ratio 0 when either gradient is zero (a
mini-batch whose advantages are all zero, e.g. no reward under raw {+1/0} rewards): such a
reading says nothing about the approximation and is left out, not taken as a fall.
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys
from typing import Literal, Sequence

import numpy as np

from rl_jax import cli
from rl_jax.analysis import aggregate
from rl_jax.analysis import runs as runs_lib
from rl_jax.analysis.runs import Group, Run

DRIFT = "drift/tv_mean"
COSINE = "first_order/cosine"
BASELINE_STEPS = 20
DRIFT_FACTOR = 2.0     # drift TV at twice its starting level
COSINE_FACTOR = 0.5    # cosine at half its starting level

Direction = Literal["up", "down"]
METERS: dict[str, tuple[Direction, float]] = {DRIFT: ("up", DRIFT_FACTOR), COSINE: ("down", COSINE_FACTOR)}


def baseline_window(steps: Sequence[int], values: Sequence[float], baseline_steps: int = BASELINE_STEPS) -> int:
  """End (exclusive step) of the baseline window: `baseline_steps`, or, for a meter first read at or
  after it (logged every `rl.meter_every` >= baseline_steps steps), just past its first finite reading."""
  finite = [s for s, v in zip(steps, values) if math.isfinite(v)]
  if not finite or finite[0] < baseline_steps:
    return baseline_steps
  return finite[0] + 1


def baseline(steps: Sequence[int], values: Sequence[float], baseline_steps: int = BASELINE_STEPS) -> float | None:
  """Median of the finite values logged in the baseline window; None when there are none."""
  end = baseline_window(steps, values, baseline_steps)
  early = [v for s, v in zip(steps, values) if s < end and math.isfinite(v)]
  return float(np.median(early)) if early else None


def alarm_step(steps: Sequence[int], values: Sequence[float], direction: Direction, factor: float,
               baseline_steps: int = BASELINE_STEPS) -> int | None:
  """First step >= baseline_steps whose value crosses factor x baseline (module docstring), or None.

  A non-finite value after the baseline is an alarm at its step (the meter itself broke down).
  """
  if direction not in ("up", "down") or factor <= 0:
    raise ValueError(f"alarm_step: direction must be 'up' or 'down' and factor > 0, got {direction!r}, {factor}")
  base = baseline(steps, values, baseline_steps)
  if base is None or base <= 0:
    return None
  end = baseline_window(steps, values, baseline_steps)
  for s, v in zip(steps, values):
    if s < end:
      continue
    if not math.isfinite(v):
      return int(s)
    if (direction == "up" and v >= factor * base) or (direction == "down" and v <= factor * base):
      return int(s)
  return None


@dataclasses.dataclass(frozen=True)
class RunPrecursor:
  """One run, one meter: its alarm and collapse steps (None: did not happen / not logged)."""
  name: str
  seed: int | None
  meter: str
  alarm: int | None
  collapse: int | None

  @property
  def kind(self) -> str:
    """'warning' (alarm at or before the collapse), 'late', 'missed' (collapse, no alarm),
    'false_alarm' (alarm, no collapse) or 'quiet' (neither)."""
    if self.collapse is not None:
      if self.alarm is None:
        return "missed"
      return "warning" if self.alarm <= self.collapse else "late"
    return "false_alarm" if self.alarm is not None else "quiet"

  @property
  def lead(self) -> int | None:
    return None if self.alarm is None or self.collapse is None else self.collapse - self.alarm


def run_precursors(run: Run, meters: dict[str, tuple[Direction, float]] = METERS,
                   baseline_steps: int = BASELINE_STEPS) -> list[RunPrecursor]:
  """One RunPrecursor per meter the run logged (one with no finite reading is left out)."""
  collapse = aggregate.run_collapse(run)
  out = []
  for meter, (direction, factor) in meters.items():
    steps, values = run.series(meter)
    if meter == COSINE:
      steps, values = aggregate.defined_cosine(run, steps, values)
    if baseline(steps, values, baseline_steps) is None:
      continue
    out.append(RunPrecursor(name=run.name, seed=run.seed, meter=meter, collapse=collapse,
                            alarm=alarm_step(steps, values, direction, factor, baseline_steps)))
  return out


def markdown(groups: Sequence[Group], meters: dict[str, tuple[Direction, float]] = METERS) -> str:
  """Per group and meter: how many collapses it warned of (median lead), missed or flagged late, and its
  false alarms among the runs that did not collapse."""
  lines = ["| run | meter | collapsed | warned (median lead, steps) | late | missed | false alarms / not collapsed |",
           "|---|---|---|---|---|---|---|"]
  for g in groups:
    per_meter: dict[str, list[RunPrecursor]] = {}
    for r in g.runs:
      for p in run_precursors(r, meters):
        per_meter.setdefault(p.meter, []).append(p)
    for meter, ps in per_meter.items():
      kinds = [p.kind for p in ps]
      leads = [p.lead for p in ps if p.kind == "warning"]
      n_coll = sum(p.collapse is not None for p in ps)
      lead_s = f" ({int(np.median(leads))})" if leads else ""
      lines.append(f"| {g.name} | {meter} | {n_coll}/{len(ps)} | {kinds.count('warning')}{lead_s} | "
                   f"{kinds.count('late')} | {kinds.count('missed')} | "
                   f"{kinds.count('false_alarm')}/{len(ps) - n_coll} |")
  return "\n".join(lines) + "\n"


# --- Collapse predictors over many runs (docs/results.md#collapse-predictors) ----------------------
#
# Declared before being applied to the headline study's meters. The event is the protocol's decline
# (round 1 called it a collapse; since issue 53 the project's one collapse is the floor event of the
# round-2 block below, and this event is named a *decline*): a run *declines* when its primary metric
# (the mean of its last 3 evaluations) ends below its warm start's accuracy (step 0), or it aborted on
# a non-finite loss; its decline step is the first evaluation from which the trailing mean of 3
# evaluations stays below step 0's (the abort step for an aborted run). Below, "collapsed" in this
# block's names means declined.
# Each meter is read against its own baseline (`baseline`), and a run's *peak excursion* is the
# largest value / baseline (an 'up' meter) or baseline / value (a 'down' meter; a reading <= 0 counts
# as infinite) over its readings after the baseline window, up to its collapse step for a run that
# collapsed and over the whole run otherwise. An alarm at factor f (`alarm_step`) is exactly an
# excursion >= f ('up') or >= 1 / f ('down'), so one number per run gives the whole ROC: at each
# factor the true-positive rate (collapsed runs warned in time) and the false-positive rate (runs that
# did not collapse but alarmed), and the AUC is the probability that a collapsed run's excursion
# exceeds a non-collapsed run's (ties half). A collapsed run's window ends at its collapse, a
# non-collapsed run's at the end: that favours false alarms, so the AUC is conservative for the meter.

PREDICTORS: dict[str, Direction] = {
    "loss/is_ess": "down",          # effective sample size of the IS ratios
    "loss/grad_norm": "up",
    "mismatch/kl_k3": "up",         # KL(q || p_old)
    DRIFT: "up",
    COSINE: "down",
}
FACTORS: dict[Direction, tuple[float, ...]] = {"up": (1.25, 1.5, 2.0, 3.0, 5.0), "down": (0.8, 0.67, 0.5, 0.33, 0.2)}
EVENT_METRIC = "eval_greedy_accuracy"
EVENT_LAST_K = 3


def decline_step(run: Run, metric: str = EVENT_METRIC, last_k: int = EVENT_LAST_K) -> int | None:
  """The run's collapse step under the decline event above, or None (no collapse, or no step-0 evaluation).

  Its primary metric is the last trailing mean, so a collapsed run always has a step."""
  if run.aborted_step is not None:
    return run.aborted_step
  steps, values = run.series(metric)
  if not steps or steps[0] != 0 or len(values) <= last_k:
    return None
  start = values[0]
  trailing = [np.mean(values[max(0, i + 1 - last_k):i + 1]) for i in range(len(values))]
  if not trailing[-1] < start:
    return None
  step = steps[-1]
  for s, v in zip(reversed(steps), reversed(trailing)):
    if not v < start:
      break
    step = s
  return step


def finished(run: Run) -> bool:
  """Whether a run is over: it aborted, or its summary reached its configured `rl.steps` (an unfinished
  run has not had its chance to collapse and would count as a non-collapse)."""
  if run.aborted_step is not None:
    return True
  steps = run.config_value("rl.steps")
  return bool(run.summary) and steps is not None and run.summary.get("steps", -1) >= int(steps)


def _meter_series(run: Run, meter: str) -> tuple[list[int], list[float]]:
  steps, values = run.series(meter)
  if meter == COSINE:
    steps, values = aggregate.defined_cosine(run, steps, values)
  return steps, values


def peak_excursion(steps: Sequence[int], values: Sequence[float], direction: Direction, end_step: int | None,
                   baseline_steps: int = BASELINE_STEPS) -> float | None:
  """The largest excursion from the baseline (above) over readings after the baseline window and at or
  before `end_step` (None: all of them); 1.0 when there is no such reading; None without a baseline."""
  base = baseline(steps, values, baseline_steps)
  if base is None or base <= 0:
    return None
  start = baseline_window(steps, values, baseline_steps)
  peak = 1.0
  for s, v in zip(steps, values):
    if s < start or (end_step is not None and s > end_step):
      continue
    if not math.isfinite(v):
      return math.inf
    x = v / base if direction == "up" else (base / v if v > 0 else math.inf)
    peak = max(peak, x)
  return peak


@dataclasses.dataclass(frozen=True)
class PredictorRow:
  """One meter over a set of runs: its AUC and, per alarm factor, (TPR, FPR, median lead in steps)."""
  meter: str
  direction: Direction
  n_collapsed: int
  n_other: int
  auc: float | None
  by_factor: tuple[tuple[float, float | None, float | None, int | None], ...]


def _auc(pos: Sequence[float], neg: Sequence[float]) -> float | None:
  if not pos or not neg:
    return None
  wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
  return wins / (len(pos) * len(neg))


def evaluate_predictors(runs: Sequence[Run], meters: dict[str, Direction] = PREDICTORS,
                        factors: dict[Direction, tuple[float, ...]] = FACTORS,
                        baseline_steps: int = BASELINE_STEPS) -> list[PredictorRow]:
  """Each meter's ROC-style row over the finished `runs` (the block comment above); runs without the
  meter, and unfinished ones, are left out."""
  runs = [r for r in runs if finished(r)]
  collapse = {id(r): decline_step(r) for r in runs}
  rows = []
  for meter, direction in meters.items():
    pos, neg, leads = [], [], {f: [] for f in factors[direction]}
    for r in runs:
      steps, values = _meter_series(r, meter)
      c = collapse[id(r)]
      x = peak_excursion(steps, values, direction, c, baseline_steps)
      if x is None:
        continue
      (pos if c is not None else neg).append(x)
      if c is not None:
        for f in factors[direction]:
          a = alarm_step(steps, values, direction, f, baseline_steps)
          if a is not None and a <= c:
            leads[f].append(c - a)
    if not pos and not neg:
      continue
    by_factor = []
    for f in factors[direction]:
      thr = f if direction == "up" else 1.0 / f
      tpr = sum(x >= thr for x in pos) / len(pos) if pos else None
      fpr = sum(x >= thr for x in neg) / len(neg) if neg else None
      by_factor.append((f, tpr, fpr, int(np.median(leads[f])) if leads[f] else None))
    rows.append(PredictorRow(meter, direction, len(pos), len(neg), _auc(pos, neg), tuple(by_factor)))
  return rows


def predictors_markdown(rows: Sequence[PredictorRow]) -> str:
  """The table of `evaluate_predictors`: one line per meter and alarm factor."""
  fmt = lambda x, d=2: "-" if x is None else f"{x:.{d}f}"
  out = ["| meter | declined / other runs | AUC | alarm at | TPR (warned in time) | FPR (false alarms) | median lead, steps |",
         "|---|---|---|---|---|---|---|"]
  for r in rows:
    for i, (f, tpr, fpr, lead) in enumerate(r.by_factor):
      head = (f"| `{r.meter}` | {r.n_collapsed} / {r.n_other} | {fmt(r.auc)} " if i == 0 else "| | | ")
      sign = ">=" if r.direction == "up" else "<="
      out.append(f"{head}| {sign} {f:g}x baseline | {fmt(tpr)} | {fmt(fpr)} | {'-' if lead is None else lead} |")
  return "\n".join(out) + "\n"


# --- Round 2 (issue 37 step 5): the same meters with the window asymmetry removed ----------------------
#
# Declared in the commit before it was first computed on any run (the dose_response runs had finished
# by then; their accuracy outcomes had been read, not these excursions). Two changes to the block above:
# 1. The event is issue 37's collapse endpoint: the first evaluation after step FLOOR_AFTER at which
#    held-out greedy accuracy is <= FLOOR (or an abort, at its step). `floor_event_step`.
# 2. Matched windows: every (collapsed run c, other run n) pair is compared over the same steps: both
#    runs' peak excursions over their readings after the baseline window and strictly before c's
#    event step t_c (a meter reading at the event step is no warning). The pair scores 1 when c's
#    excursion is larger, 1/2 on a tie; the matched AUC is the mean over pairs. Pairs are pooled over
#    the study's runs (primary) and, secondary, formed only within one panel (one regime), which
#    removes the pooling of regimes too. 95% CI: percentile bootstrap, BOOTSTRAP resamples of the
#    collapsed and the other runs drawn apart, with replacement (seed 0).
FLOOR = aggregate.COLLAPSE_FLOOR        # 0.005: the one collapse definition's floor
FLOOR_AFTER = aggregate.COLLAPSE_AFTER  # 20
BOOTSTRAP = 2000


def floor_event_step(run: Run, metric: str = EVENT_METRIC) -> int | None:
  """The step of the first evaluation after FLOOR_AFTER at or below FLOOR, the abort step of an aborted
  run when no evaluation before it got there, or None: the declared event, as the protocol's
  `floor_event` reads it. (Until 2026-12-06 an aborted run's event was its abort step even when an
  earlier evaluation had reached the floor, which put readings after the event in its window; no
  published run had aborted, so no published figure changes.)"""
  return aggregate.run_collapse(run, metric, FLOOR, FLOOR_AFTER)


def _excursion_before(steps, values, direction: Direction, end: int, baseline_steps: int) -> float | None:
  return peak_excursion(steps, values, direction, end - 1, baseline_steps)


def matched_pairs(runs: Sequence[Run], meter: str, direction: Direction, within_panel: bool = False,
                  panel_of=None, baseline_steps: int = BASELINE_STEPS) -> list[tuple[int, int, float]]:
  """(collapsed index, other index, pair score) over the finished `runs` with the meter (block above)."""
  runs = [r for r in runs if finished(r)]
  series = [_meter_series(r, meter) for r in runs]
  events = [floor_event_step(r) for r in runs]
  pairs = []
  for i, (c, t) in enumerate(zip(runs, events)):
    if t is None:
      continue
    xc = _excursion_before(*series[i], direction, t, baseline_steps)
    if xc is None:
      continue
    for j, n in enumerate(runs):
      if events[j] is not None or (within_panel and panel_of(c) != panel_of(n)):
        continue
      xn = _excursion_before(*series[j], direction, t, baseline_steps)
      if xn is None:
        continue
      pairs.append((i, j, 1.0 if xc > xn else 0.5 if xc == xn else 0.0))
  return pairs


def matched_auc(pairs: Sequence[tuple[int, int, float]], resamples: int = BOOTSTRAP,
                seed: int = 0) -> tuple[float | None, float | None, float | None, int, int]:
  """(AUC, CI low, CI high, collapsed runs, other runs) of `matched_pairs`' output (block above)."""
  if not pairs:
    return None, None, None, 0, 0
  cs = sorted({i for i, _, _ in pairs})
  ns = sorted({j for _, j, _ in pairs})
  score = {(i, j): s for i, j, s in pairs}
  auc = float(np.mean([s for _, _, s in pairs]))
  rng = np.random.default_rng(seed)
  boots = []
  for _ in range(resamples):
    bc = rng.choice(cs, size=len(cs))
    bn = rng.choice(ns, size=len(ns))
    vals = [score[(i, j)] for i in bc for j in bn if (i, j) in score]
    if vals:
      boots.append(np.mean(vals))
  lo, hi = (np.percentile(boots, [2.5, 97.5]) if boots else (None, None))
  return auc, (None if lo is None else float(lo)), (None if hi is None else float(hi)), len(cs), len(ns)


def matched_markdown(runs: Sequence[Run], panel_of, meters: dict[str, Direction] = PREDICTORS) -> str:
  """The matched-window AUC table: one row per meter, pooled and within-panel (block above)."""
  fmt = lambda x: "-" if x is None else f"{x:.2f}"
  out = ["| meter | pooled: collapsed / other runs | pooled AUC [95% CI] | within panel: pairs | within-panel AUC [95% CI] |",
         "|---|---|---|---|---|"]
  for meter, direction in meters.items():
    pooled = matched_pairs(runs, meter, direction)
    within = matched_pairs(runs, meter, direction, within_panel=True, panel_of=panel_of)
    a, lo, hi, nc, nn = matched_auc(pooled)
    b, blo, bhi, _, _ = matched_auc(within)
    out.append(f"| `{meter}` | {nc} / {nn} | {fmt(a)} [{fmt(lo)}, {fmt(hi)}] | {len(within)} | "
               f"{fmt(b)} [{fmt(blo)}, {fmt(bhi)}] |")
  return "\n".join(out) + "\n"


@cli.expected_errors("python -m rl_jax.analysis.precursors")
def main(argv: list[str] | None = None) -> int:
  """python -m rl_jax.analysis.precursors --workdirs 'ROOT/*/*/seed*': the predictor table of those runs."""
  import argparse  # pylint: disable=g-import-not-at-top
  p = argparse.ArgumentParser(prog="python -m rl_jax.analysis.precursors",
                              description="ESS, gradient norm, KL, drift and first-order cosine as predictors of a collapse")
  p.add_argument("--workdirs", nargs="+", required=True, help="globs of RL workdirs (quote them)")
  p.add_argument("--out", default=None, help="also write the table to this markdown file")
  p.add_argument("--matched", action="store_true",
                 help="issue 37's matched-window AUCs against the accuracy-floor event instead (panels = the "
                      "workdir's grandparent directory, as a study lays runs out: ROOT/PANEL/LINE/seedN)")
  a = p.parse_args(argv)
  found = runs_lib.load_runs(a.workdirs)
  if not found:
    print(f"{p.prog}: error: --workdirs {a.workdirs}: no RL workdir with a metrics.jsonl matched",
          file=sys.stderr)
    return cli.CONFIG_ERROR
  done = [r for r in found if finished(r)]
  if a.matched:
    table = matched_markdown(found, panel_of=lambda r: os.path.basename(os.path.dirname(os.path.dirname(
        os.path.normpath(r.workdir)))))
    print(f"{len(done)} finished runs of {len(found)}; {sum(floor_event_step(r) is not None for r in done)} "
          f"reached accuracy <= {FLOOR:g} after step {FLOOR_AFTER}\n")
    print(table)
    if a.out:
      with open(a.out, "w", encoding="utf-8") as f:
        f.write(table)
    return 0
  table = predictors_markdown(evaluate_predictors(found))
  print(f"{len(done)} finished runs of {len(found)}; {sum(decline_step(r) is not None for r in done)} declined "
        "(ended below the warm start; round 1's event, not a collapse)\n")
  print(table)
  if a.out:
    with open(a.out, "w", encoding="utf-8") as f:
      f.write(table)
  return 0


if __name__ == "__main__":
  sys.exit(main())
