"""Where a run went wrong: the first KL spike, entropy collapse, clip fractions and the accuracy collapse."""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from rl_jax.analysis import aggregate
from rl_jax.analysis.runs import Run

# k3, not k1: k1 averages signed log-ratios, is negative on about half the steps of a small
# mismatch, and a spike finder on it flags its noise (notebooks/explore_mismatch.ipynb).
KL = "mismatch/kl_k3"
ENTROPY = "loss/entropy"
SPIKE_FACTOR = 3.0   # a value this many times the median of the steps before it is a spike
SPIKE_WINDOW = 5     # how many earlier steps the median looks at
SPIKE_FLOOR = 1e-4   # values below this never count as a spike (fp32 noise around zero KL)
ENTROPY_FRACTION = 0.5


def first_spike(steps: Sequence[int], values: Sequence[float], factor: float = SPIKE_FACTOR,
                window: int = SPIKE_WINDOW, floor: float = SPIKE_FLOOR) -> int | None:
  """First step whose value exceeds `factor` x the median of the up-to-`window` finite values before it
  (and `floor`), or the first non-finite value; None if neither happens.

  The first step has no history and is never a spike; a median, not a mean, so one earlier
  spike does not hide the next.
  """
  if factor <= 1 or window < 1:
    raise ValueError(f"first_spike: need factor > 1 and window >= 1, got {factor}, {window}")
  history: list[float] = []
  for s, v in zip(steps, values):
    if not np.isfinite(v):
      return int(s)
    if history and v > floor and v > factor * float(np.median(history[-window:])):
      return int(s)
    history.append(float(v))
  return None


def first_below(steps: Sequence[int], values: Sequence[float], fraction: float = ENTROPY_FRACTION) -> int | None:
  """First step whose value falls below `fraction` x the first finite value (e.g. entropy collapse), else None."""
  if not 0 < fraction < 1:
    raise ValueError(f"first_below: need 0 < fraction < 1, got {fraction}")
  ref = None
  for s, v in zip(steps, values):
    if not np.isfinite(v):
      return int(s)
    if ref is None:
      ref = v
    elif ref > 0 and v < fraction * ref:
      return int(s)
  return None


def clip_fractions(run: Run) -> dict[str, tuple[float, float, int]]:
  """Every logged fraction of the loss (`loss/frac_clipped`, `loss/frac_masked`, ...): (mean, max, step of max)."""
  keys = sorted({k for r in run.rows for k in r if "frac" in k.rsplit("/", 1)[-1]})
  out = {}
  for k in keys:
    steps, vals = run.series(k)
    if vals:
      v = np.asarray(vals, np.float64)
      i = int(np.nanargmax(v)) if np.isfinite(v).any() else 0
      out[k] = (float(np.nanmean(v)), float(v[i]), int(steps[i]))
  return out


@dataclasses.dataclass
class Diagnosis:
  """What went wrong in one run and when (None: it did not happen, or the metric was not logged)."""
  name: str
  last_step: int
  kl_spike_step: int | None
  entropy_collapse_step: int | None
  accuracy_collapse_step: int | None
  aborted_step: int | None
  clip: dict[str, tuple[float, float, int]]

  @property
  def first_problem(self) -> tuple[str, int] | None:
    """(what, step) of the earliest problem, or None for a healthy run."""
    events = [(s, w) for w, s in (("KL spike", self.kl_spike_step), ("entropy collapse", self.entropy_collapse_step),
                                  ("accuracy collapse", self.accuracy_collapse_step),
                                  ("non-finite abort", self.aborted_step)) if s is not None]
    return (min(events)[1], min(events)[0]) if events else None


def diagnose(run: Run, kl_metric: str = KL, entropy_metric: str = ENTROPY, factor: float = SPIKE_FACTOR,
             window: int = SPIKE_WINDOW, entropy_fraction: float = ENTROPY_FRACTION) -> Diagnosis:
  """The finders above on one run's logged curves, plus `aggregate.run_collapse` on held-out accuracy."""
  return Diagnosis(name=run.name, last_step=run.last_step,
                   kl_spike_step=first_spike(*run.series(kl_metric), factor=factor, window=window),
                   entropy_collapse_step=first_below(*run.series(entropy_metric), fraction=entropy_fraction),
                   accuracy_collapse_step=aggregate.run_collapse(run), aborted_step=run.aborted_step,
                   clip=clip_fractions(run))


def markdown(diagnoses: Sequence[Diagnosis]) -> str:
  """One row per run: the step of each problem ('-' when none) and its largest clip fraction."""
  fmt = lambda s: "-" if s is None else str(s)
  lines = ["| run | steps | KL spike | entropy collapse | accuracy collapse | abort | max clip fraction |",
           "|---|---|---|---|---|---|---|"]
  for d in diagnoses:
    clip = max(d.clip.items(), key=lambda kv: kv[1][1], default=None)
    clip_s = "-" if clip is None else f"{clip[0]} {clip[1][1]:.3g} @ {clip[1][2]}"
    lines.append(f"| {d.name} | {d.last_step} | {fmt(d.kl_spike_step)} | {fmt(d.entropy_collapse_step)} | "
                 f"{fmt(d.accuracy_collapse_step)} | {fmt(d.aborted_step)} | {clip_s} |")
  return "\n".join(lines)
