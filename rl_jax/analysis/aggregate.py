"""Statistics over seeds: mean and standard error, centered moving average, collapse detection.

Standard error: s.e. = std(values, ddof=1) / sqrt(n) over the n seeds that logged a step;
undefined (nan, no shading) for n = 1.

Collapse (of one run, on one curve, by default held-out greedy accuracy at each evaluation): the
  project's one definition, the protocol's declared collapse endpoint (docs/results.md#protocol):
  the step of the first evaluation after step `after` (20) at or below `floor` (0.005), or of the
  first non-finite evaluation after it (a diverged policy answers nothing); or, for a run the
  trainer aborted on a non-finite loss/gradient (`Run.aborted_step`), that step when no evaluation
  before it reached the floor. A run that never collapsed has collapse step None. The exploratory
  studies' earlier criterion (two consecutive evaluations below half the running best) flagged
  recoverable dips; it is no longer computed, and the tables published under it say so.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from rl_jax.analysis.runs import Group, Run

COLLAPSE_FLOOR = 0.005
COLLAPSE_AFTER = 20
COLLAPSE_METRIC = "eval_greedy_accuracy"
ACCURACY = "eval_greedy_accuracy"
KL = "mismatch/kl_k1"


def mean_se(values: Sequence[float]) -> tuple[float, float, int]:
  """(mean, standard error with ddof=1, n) of the finite values; s.e. is nan for n < 2."""
  x = np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=np.float64)
  n = int(x.size)
  if n == 0:
    return math.nan, math.nan, 0
  se = float(x.std(ddof=1) / math.sqrt(n)) if n > 1 else math.nan
  return float(x.mean()), se, n


def moving_average(ys: Sequence[float], window: int) -> np.ndarray:
  """Centered moving average; the window shrinks at the ends (no padding) and skips nans."""
  y = np.asarray(ys, dtype=np.float64)
  half = window // 2
  out = np.full(y.shape, np.nan)
  for i in range(y.size):
    w = y[max(0, i - half):i + half + 1]
    w = w[np.isfinite(w)]
    if w.size:
      out[i] = w.mean()
  return out


@dataclasses.dataclass
class Curve:
  """A metric over steps across seeds: per step the mean, s.e. and how many seeds logged it."""
  steps: np.ndarray
  mean: np.ndarray
  se: np.ndarray
  n: np.ndarray


def aggregate_curve(runs: Sequence[Run], metric: str) -> Curve:
  """Mean and s.e. at every step any run logged `metric` (seeds that stopped early drop out)."""
  by_step: dict[int, list[float]] = {}
  for r in runs:
    for s, v in zip(*r.series(metric)):
      by_step.setdefault(s, []).append(v)
  steps = sorted(by_step)
  stats = [mean_se(by_step[s]) for s in steps]
  return Curve(steps=np.asarray(steps, dtype=np.int64),
               mean=np.asarray([m for m, _, _ in stats]), se=np.asarray([e for _, e, _ in stats]),
               n=np.asarray([k for _, _, k in stats], dtype=np.int64))


def collapse_step(steps: Sequence[int], values: Sequence[float], floor: float = COLLAPSE_FLOOR,
                  after: int = COLLAPSE_AFTER, aborted_step: int | None = None) -> int | None:
  """The collapse step of one curve (module docstring), or None; `aborted_step` the run's abort."""
  if not 0 <= floor < 1 or after < 0:
    raise ValueError(f"collapse: need 0 <= floor < 1 and after >= 0, got {floor}, {after}")
  hit = next((int(s) for s, v in zip(steps, values) if s > after and not (math.isfinite(v) and v > floor)),
             None)
  if aborted_step is not None and (hit is None or aborted_step < hit):
    return int(aborted_step)
  return hit


def run_collapse(run: Run, metric: str = COLLAPSE_METRIC, floor: float = COLLAPSE_FLOOR,
                 after: int = COLLAPSE_AFTER) -> int | None:
  steps, values = run.series(metric)
  return collapse_step(steps, values, floor, after, run.aborted_step)


@dataclasses.dataclass
class GroupSummary:
  """One table row: a run name's numbers over its seeds (mean, s.e., n)."""
  name: str
  panel: str
  line: str
  seeds: list[int | None]
  final_accuracy: tuple[float, float, int]
  best_accuracy: tuple[float, float, int]
  final_reward: tuple[float, float, int]
  mean_kl: tuple[float, float, int]
  collapse_steps: list[int | None]
  extra: dict[str, tuple[float, float, int]]

  @property
  def n_collapsed(self) -> int:
    return sum(c is not None for c in self.collapse_steps)

  def as_dict(self) -> dict:
    def ms(t):
      return {"mean": t[0], "se": t[1], "n": t[2]}
    return {"name": self.name, "panel": self.panel, "line": self.line, "seeds": self.seeds,
            "final_accuracy": ms(self.final_accuracy), "best_accuracy": ms(self.best_accuracy),
            "final_reward": ms(self.final_reward), "mean_kl": ms(self.mean_kl),
            "collapse_steps": self.collapse_steps, "n_collapsed": self.n_collapsed,
            **{k: ms(v) for k, v in self.extra.items()}}


# Per-run means reported when any run logged them (the meters).
COSINE = "first_order/cosine"
NORM_RATIO = "first_order/norm_ratio"
# The loss module's drop fractions (responses a sequence-level method or the rejection switch left out).
EXTRA_MEANS = ("drift/tv_mean", COSINE, "loss/seq_frac_dropped", "loss/seq_frac_rejected")
# The mean held-out accuracy over the evaluations in the second half of a run (steps in (S/2, S],
# S its last evaluated step): the protocol studies' primary window, reported for every group.
SECOND_HALF = "second-half eval_greedy_accuracy"


def defined_cosine(run: Run, steps: Sequence[int], values: Sequence[float]) -> tuple[list[int], list[float]]:
  """The first-order cosine readings whose gradients were not zero: the meter reports cosine 0 and
  norm ratio 0 when either is (a mini-batch with all-zero advantages, e.g. no reward under raw
  {+1/0} rewards), a reading that says nothing about the approximation."""
  ratio = dict(zip(*run.series(NORM_RATIO)))
  keep = [(s, v) for s, v in zip(steps, values) if not (v == 0.0 and ratio.get(s) == 0.0)]
  return [s for s, _ in keep], [v for _, v in keep]


def summarize_group(group: Group, accuracy: str = ACCURACY, collapse_metric: str = COLLAPSE_METRIC,
                    floor: float = COLLAPSE_FLOOR, after: int = COLLAPSE_AFTER) -> GroupSummary:
  """Final / best held-out accuracy, final reward and per-run mean KL over seeds, and each seed's collapse."""
  def per_run(metric: str, reduce) -> list[float]:
    out = []
    for r in group.runs:
      steps, v = r.series(metric)
      if metric == COSINE:
        _, v = defined_cosine(r, steps, v)
      if v:
        out.append(reduce(v))
    return out

  def mean_finite(v):
    x = [a for a in v if math.isfinite(a)]
    return float(np.mean(x)) if x else math.nan

  def best(v):
    x = [a for a in v if math.isfinite(a)]
    return max(x) if x else math.nan

  def second_half(r: Run) -> float | None:
    steps, v = r.series(accuracy)
    if not steps:
      return None
    return mean_finite([x for s, x in zip(steps, v) if 2 * s > steps[-1]])

  halves = [h for h in (second_half(r) for r in group.runs) if h is not None]
  extra = {SECOND_HALF: mean_se(halves)} if halves else {}
  extra.update({m: mean_se(per_run(m, mean_finite)) for m in EXTRA_MEANS if any(r.has(m) for r in group.runs)})
  return GroupSummary(
      name=group.name, panel=group.panel, line=group.line, seeds=[r.seed for r in group.runs],
      final_accuracy=mean_se(per_run(accuracy, lambda v: v[-1])),
      best_accuracy=mean_se(per_run(accuracy, best)),
      final_reward=mean_se(per_run("reward", lambda v: v[-1])),
      mean_kl=mean_se(per_run(KL, mean_finite)),
      collapse_steps=[run_collapse(r, collapse_metric, floor, after) for r in group.runs],
      extra=extra)
