"""Paired statistics of a pre-registered contrast: t and Wilcoxon tests, CI, Holm, power (pure functions)."""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

import numpy as np
from scipy import stats as sps


@dataclasses.dataclass(frozen=True)
class PairedTest:
  """A - B over the seeds both lines ran (the same seed = the same noise, prompts and eval set).

  `mean`, `sd`, `se` are of the paired differences d_s = A_s - B_s; `ci` the two-sided
  (1 - alpha) t interval of their mean; `p_t` the paired t-test's two-sided p; `p_wilcoxon`
  the Wilcoxon signed-rank test's, exact at every n, ties included (`wilcoxon_p`).
  """
  n: int
  seeds: tuple[int, ...]
  diffs: tuple[float, ...]
  mean: float
  sd: float
  se: float
  t: float
  df: int
  p_t: float
  p_wilcoxon: float
  ci: tuple[float, float]
  alpha: float

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


def paired(a: Mapping[int, float], b: Mapping[int, float]) -> tuple[list[int], np.ndarray]:
  """(seeds in both, d = a - b over them), seeds ascending; non-finite values are refused."""
  seeds = sorted(set(a) & set(b))
  d = np.asarray([a[s] - b[s] for s in seeds], np.float64)
  if not np.all(np.isfinite(d)):
    bad = [s for s, x in zip(seeds, d) if not math.isfinite(x)]
    raise ValueError(f"paired difference not finite at seeds {bad}: the primary metric must be defined "
                     "for every run (study.protocol fills what an aborted run did not reach)")
  return seeds, d


# Differences equal to this many decimals are ties (the primary metric is a mean of k / eval_size
# accuracies: equal differences may disagree in the last bits of a float).
TIE_DECIMALS = 12
WILCOXON_METHOD = "exact Wilcoxon signed-rank (sign-flip distribution of midranks, zeros dropped)"


def wilcoxon_p(d: Sequence[float]) -> float:
  """Two-sided exact Wilcoxon signed-rank p of `d`; 1.0 when every difference is zero.

  Zero differences are dropped (Wilcoxon's convention); tied |d| get their midrank. Under H0 each
  remaining difference is + or - with probability 1/2 independently, so the null distribution of
  W+ (the sum of the positive differences' ranks) is that of sum_i s_i r_i over the 2^n equally
  likely sign vectors s, with the observed (mid)ranks r: the exact conditional distribution, ties
  included, computed by convolution over doubled ranks (integers). p = min(1, 2 min(P(W+ <= w),
  P(W+ >= w))). No normal approximation at any n, and no dependence on the SciPy version (whose
  `method='auto'` switches between an exact table, a permutation test and the normal approximation
  by n and ties).
  """
  d = np.round(np.asarray(d, np.float64), TIE_DECIMALS)
  d = d[d != 0]
  if d.size == 0:
    return 1.0
  r2 = np.rint(2 * sps.rankdata(np.abs(d))).astype(np.int64)   # doubled midranks: integers
  dist = np.zeros(int(r2.sum()) + 1)
  dist[0] = 1.0
  for r in r2:  # each rank joins W+ (shift by r) or not, with probability 1/2 each
    dist = 0.5 * (dist + np.concatenate([np.zeros(r), dist[:dist.size - r]]))
  w = int(r2[d > 0].sum())
  return float(min(1.0, 2 * min(dist[:w + 1].sum(), dist[w:].sum())))


def paired_test(a: Mapping[int, float], b: Mapping[int, float], alpha: float = 0.05) -> PairedTest:
  """The paired t-test, Wilcoxon test and (1 - alpha) CI of mean(A - B); needs >= 2 common seeds."""
  seeds, d = paired(a, b)
  n = d.size
  if n < 2:
    raise ValueError(f"a paired test needs >= 2 seeds both lines ran, got {n} ({seeds})")
  mean, sd = float(d.mean()), float(d.std(ddof=1))
  se = sd / math.sqrt(n)
  df = n - 1
  half = float(sps.t.ppf(1 - alpha / 2, df)) * se
  if se > 0:
    t = mean / se
    p = float(2 * sps.t.sf(abs(t), df))
  else:  # every difference equal: no variance to test against
    t = math.copysign(math.inf, mean) if mean else 0.0
    p = 0.0 if mean else 1.0
  return PairedTest(n=n, seeds=tuple(seeds), diffs=tuple(float(x) for x in d), mean=mean, sd=sd, se=se,
                    t=float(t), df=df, p_t=p, p_wilcoxon=wilcoxon_p(d), ci=(mean - half, mean + half),
                    alpha=alpha)


def holm(pvalues: Sequence[float]) -> list[float]:
  """Holm-Bonferroni adjusted p-values (same order as given): step-down, monotone, capped at 1."""
  p = np.asarray(pvalues, np.float64)
  m = p.size
  order = np.argsort(p, kind="stable")
  out = np.empty(m)
  running = 0.0
  for rank, i in enumerate(order):
    running = max(running, min(1.0, (m - rank) * p[i]))
    out[i] = running
  return [float(x) for x in out]


def power(n: int, sd_d: float, delta: float, alpha: float = 0.05) -> float:
  """Power of the two-sided paired t-test with n pairs to detect a true mean difference `delta`
  when the differences have s.d. `sd_d` (noncentral t)."""
  if n < 2 or sd_d <= 0:
    return math.nan
  df = n - 1
  nc = delta / (sd_d / math.sqrt(n))
  crit = sps.t.ppf(1 - alpha / 2, df)
  return float(sps.nct.sf(crit, df, nc) + sps.nct.cdf(-crit, df, nc))


def min_detectable(n: int, sd_d: float, alpha: float = 0.05, target: float = 0.8) -> float:
  """The smallest |mean difference| the paired t-test detects with power `target` (bisection)."""
  if n < 2 or sd_d <= 0:
    return math.nan
  lo, hi = 0.0, sd_d
  while power(n, sd_d, hi, alpha) < target:
    hi *= 2
  for _ in range(60):
    mid = (lo + hi) / 2
    lo, hi = (mid, hi) if power(n, sd_d, mid, alpha) < target else (lo, mid)
  return hi


def seeds_for_power(sd_d: float, delta: float, alpha: float = 0.05, target: float = 0.8,
                    max_n: int = 1000) -> int | None:
  """The smallest n with power >= `target` at `delta`, or None beyond `max_n`."""
  for n in range(2, max_n + 1):
    if power(n, sd_d, delta, alpha) >= target:
      return n
  return None


MCNEMAR_METHOD = "exact McNemar (two-sided binomial test on the discordant pairs, p = 1 with none)"


@dataclasses.dataclass(frozen=True)
class PairedEvents:
  """A binary event (a run's collapse) in arms A and B over the seeds both ran: the discordant counts
  `a_only` (A's run had the event, B's did not) and `b_only`, and the exact McNemar p."""
  n: int
  a_events: int
  b_events: int
  a_only: int
  b_only: int
  p: float

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


def mcnemar_exact_p(a_only: int, b_only: int) -> float:
  """Two-sided exact McNemar p: under H0 each discordant pair is A-only or B-only with probability 1/2,
  so p = min(1, 2 P(X <= min(a_only, b_only))) with X ~ Binomial(a_only + b_only, 1/2); 1 with none."""
  m = a_only + b_only
  if m == 0:
    return 1.0
  k = min(a_only, b_only)
  return float(min(1.0, 2 * sum(math.comb(m, i) for i in range(k + 1)) / 2 ** m))


def paired_events(a: Mapping[int, bool], b: Mapping[int, bool]) -> PairedEvents:
  """The event counts and McNemar test of arms a and b over the seeds both ran."""
  seeds = sorted(set(a) & set(b))
  a_only = sum(1 for s in seeds if a[s] and not b[s])
  b_only = sum(1 for s in seeds if b[s] and not a[s])
  return PairedEvents(n=len(seeds), a_events=sum(1 for s in seeds if a[s]), b_events=sum(1 for s in seeds if b[s]),
                      a_only=a_only, b_only=b_only, p=mcnemar_exact_p(a_only, b_only))


def format_p(p: float, alpha: float = 0.05) -> str:
  """p to 3 significant digits, or more where 3 would print it on the other side of alpha or at it
  (a Holm p of 0.04999 is not "0.05"): the printed value reads against alpha as the verdict does."""
  for digits in range(3, 10):
    text = f"{p:.{digits}g}"
    if (float(text) < alpha) == (p < alpha) and (float(text) != alpha or p == alpha):
      return text
  return repr(p)


def event_verdict(name_a: str, name_b: str, ev: PairedEvents, p_holm: float, alpha: float) -> str:
  """The collapse endpoint's mechanical reading: a direction when the Holm-corrected McNemar p < alpha."""
  counts = (f"{name_a} {ev.a_events}/{ev.n}, {name_b} {ev.b_events}/{ev.n}; discordant {ev.a_only} / "
            f"{ev.b_only}; exact McNemar p = {format_p(ev.p, alpha)}, Holm {format_p(p_holm, alpha)}")
  if p_holm < alpha:
    fewer = name_a if ev.a_only < ev.b_only else name_b
    return f"**{fewer} collapses less often** ({counts})"
  return f"**null**: no difference in collapses detected ({counts} >= {alpha:g})"


def verdict(name_a: str, name_b: str, test: PairedTest, p_holm: float, p_holm_wilcoxon: float,
            alpha: float) -> str:
  """The mechanical reading: a direction when the Holm-corrected paired-t p < alpha, else a null.

  The CI is the unadjusted (1 - alpha) interval of the mean paired difference; the exact Wilcoxon
  signed-rank test (`wilcoxon_p`, Holm-corrected over the same contrasts) is the robustness check,
  named when it disagrees.
  """
  lo, hi = test.ci
  ci = f"mean difference {test.mean:+.3f}, {100 * (1 - alpha):.0f}% CI [{lo:+.3f}, {hi:+.3f}], n = {test.n}"
  if p_holm < alpha:
    head = f"{name_a} > {name_b}" if test.mean > 0 else f"{name_a} < {name_b}"
    text = f"**{head}** ({ci}; paired t p = {format_p(test.p_t, alpha)}, Holm {format_p(p_holm, alpha)})"
  else:
    text = (f"**null**: no difference between {name_a} and {name_b} detected ({ci}; paired t p = "
            f"{format_p(test.p_t, alpha)}, Holm {format_p(p_holm, alpha)} >= {alpha:g})")
  if (p_holm_wilcoxon < alpha) != (p_holm < alpha):
    text += (f"; the exact Wilcoxon signed-rank test disagrees (p = {format_p(test.p_wilcoxon, alpha)}, "
             f"Holm {format_p(p_holm_wilcoxon, alpha)})")
  return text
