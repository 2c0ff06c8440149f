"""Do the meters warn before a collapse? Per run, when the drift TV rises and the first-order cosine falls.

For one run and one meter:
  baseline = median of the meter's values logged at steps < `baseline_steps` (the run's start,
             before the policy has moved far from its warm start); a meter first read later
             (every `rl.meter_every` >= baseline_steps steps) takes its first reading;
  alarm    = the first later step at which the meter crosses `factor` x baseline: upward for the
             drift meter (`drift/tv_mean`, which grows as trainer and sampler part), downward for the
             first-order cosine (`first_order/cosine`, which falls as the token-level objective stops
             approximating the sequence-level one). A baseline <= 0 gives no alarm (nothing to scale).
Against the run's accuracy collapse (`aggregate.run_collapse`), an alarm is a *warning* when it comes
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
from typing import Literal, Sequence

import numpy as np

from rl_jax.analysis import aggregate
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
