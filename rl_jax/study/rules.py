"""Selection rules of the calibration studies, read mechanically off the per-seed table (pure functions).

Each rule takes the study's RunScores and returns (markdown table, decision text, decision dict).
They are fixed in code before the calibration they read runs (rl_jax/study/studies.py names them).
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

from rl_jax.study.protocol import RunScore

Rule = Callable[[Sequence[RunScore]], tuple[str, str, dict]]
CLEAN = "clean"


def _by_panel(scores: Sequence[RunScore]) -> dict[str, dict[int, RunScore]]:
  out: dict[str, dict[int, RunScore]] = {}
  for s in scores:
    out.setdefault(s.panel, {})[s.seed] = s
  return out


def _f(x: float | None, digits: int = 3) -> str:
  return "-" if x is None or not math.isfinite(x) else f"{x:.{digits}f}"


def _g(x: float | None) -> str:
  return "-" if x is None or not math.isfinite(x) else f"{x:.2g}"


def _mean(xs) -> float | None:
  xs = [x for x in xs if x is not None and math.isfinite(x)]
  return sum(xs) / len(xs) if xs else None


# A learning rate whose mean primary metric is within this of the best counts as tied with it.
LR_TIE = 0.01


def best_lr(scores: Sequence[RunScore]) -> tuple[str, str, dict]:
  """Panels `lr_<value>` of the clean arm: the lr with the highest mean primary metric over seeds,
  among those where every seed learned (none collapsed, aborted or never learned); an lr within
  LR_TIE of the best is tied with it and the smallest tied lr is chosen (the most stable step)."""
  panels = _by_panel(scores)
  rows, ok = [], {}
  for panel, seeds in sorted(panels.items(), key=lambda kv: float(kv[0].split("_", 1)[1])):
    lr = float(panel.split("_", 1)[1])
    prim = [s.primary for s in seeds.values()]
    good = all(s.outcome == "learned" and s.aborted_step is None for s in seeds.values()) and None not in prim
    m = _mean(prim)
    if good:
      ok[lr] = m
    rows.append(f"| {lr:g} | {len(seeds)} | " + ", ".join(_f(s.primary) for _, s in sorted(seeds.items()))
                + f" | {_f(m)} | " + ", ".join(str(s.outcome) for _, s in sorted(seeds.items()))
                + f" | {'yes' if good else 'no'} |")
  table = "\n".join(["| lr | seeds | primary per seed | mean | outcomes | every seed learned |",
                     "|---|---|---|---|---|---|", *rows]) + "\n"
  if not ok:
    return table, "No learning rate learned on every seed: none is chosen.", {"lr": None}
  best = max(ok.values())
  chosen = min(lr for lr, m in ok.items() if m >= best - LR_TIE)
  text = (f"Chosen: **lr = {chosen:g}** (mean primary {ok[chosen]:.3f}; best {best:.3f}; "
          f"ties within {LR_TIE} go to the smaller lr).")
  return table, text, {"lr": chosen, "mean_primary": ok[chosen]}


# `bites`: PG keeps less than this share of the clean arm's gain on every seed...
BITE_GAIN_SHARE = 0.5
# ...while the sampler still earns at least this share of the clean sampler's first-step accuracy.
BITE_FIRST_STEP_SHARE = 0.8
# The routing-flip regime: mean routing agreement (trainer vs sampler experts) at most this.
ROUTING_FLIP = 0.90


def bites(scores: Sequence[RunScore]) -> tuple[str, str, dict]:
  """Panels = sampler regimes with a `clean` panel, line PG. A regime bites when on every seed PG's
  gain (primary - warm start) is < BITE_GAIN_SHARE x the clean arm's gain on the same seed, and its
  mean first-step train accuracy is >= BITE_FIRST_STEP_SHARE x the clean arm's (drift, not a sampler
  broken from step 0). Chosen: the biting regime with the smallest mean KL k1 (the mildest
  mismatch that bites); the routing-flip regime: the one with the smallest KL among those with mean
  routing agreement <= ROUTING_FLIP, biting or not."""
  panels = _by_panel(scores)
  if CLEAN not in panels:
    raise ValueError(f"rule 'bites' needs a '{CLEAN}' panel; panels: {sorted(panels)}")
  clean = panels[CLEAN]
  clean_first = _mean(s.first_train_accuracy for s in clean.values())
  rows, biting, flipping = [], {}, {}
  for panel, seeds in panels.items():
    shares, per_seed = [], []
    for seed, s in sorted(seeds.items()):
      c = clean.get(seed)
      if s.primary is None or s.start is None or c is None or c.primary is None or c.start is None:
        shares.append(None)
        continue
      clean_gain = c.primary - c.start
      shares.append((s.primary - s.start) / clean_gain if clean_gain > 0 else None)
    first = _mean(s.first_train_accuracy for s in seeds.values())
    first_share = first / clean_first if first is not None and clean_first else None
    kl, route = _mean(s.mean_kl for s in seeds.values()), _mean(s.mean_routing_agreement for s in seeds.values())
    lost = bool(shares) and all(x is not None and x < BITE_GAIN_SHARE for x in shares)
    bite = panel != CLEAN and lost and first_share is not None and first_share >= BITE_FIRST_STEP_SHARE
    if bite:
      biting[panel] = kl if kl is not None else math.inf
    if panel != CLEAN and route is not None and route <= ROUTING_FLIP:
      flipping[panel] = kl if kl is not None else math.inf
    per_seed = ", ".join(_f(s.primary) for _, s in sorted(seeds.items()))
    verdict = "reference" if panel == CLEAN else ("**bites**" if bite else
                                                   ("broken at step 0" if lost else "no"))
    rows.append(f"| {panel} | {per_seed} | {', '.join(_f(x, 2) for x in shares)} | {_f(first)} "
                f"({_f(first_share, 2)}) | {_g(kl)} | {_f(route)} | "
                + ", ".join(str(s.outcome) for _, s in sorted(seeds.items())) + f" | {verdict} |")
  table = "\n".join([
      "| regime | primary per seed | share of the clean gain per seed | first-step train acc (share of clean) "
      "| mean KL k1 | mean routing agreement | outcomes | bites? |", "|---|---|---|---|---|---|---|---|",
      *rows]) + "\n"
  chosen = min(biting, key=biting.get) if biting else None
  flip = min(flipping, key=flipping.get) if flipping else None
  text = (f"Biting regimes: {', '.join(sorted(biting)) or 'none'}. Chosen headline regime: "
          f"**{chosen or 'none (the second warm start is next)'}**. Routing-flip regime (agreement <= "
          f"{ROUTING_FLIP:g}): **{flip or 'none (the 16-expert warm start is next)'}**.")
  return table, text, {"regime": chosen, "routing_flip": flip, "biting": sorted(biting)}


RULES: dict[str, Rule] = {"best_lr": best_lr, "bites": bites}


def planning_from(scores: Sequence[RunScore]) -> dict:
  """What a calibration says for the power of the contrasts that follow it: the pooled within-cell
  s.d. of the primary metric over seeds (every cell with >= 2 seeds), the paired s.d. of a
  difference between two lines that assumes no within-seed correlation (sqrt(2) x, conservative
  when pairing helps), and the effect of interest, half the clean arm's mean gain."""
  panels = _by_panel(scores)
  ss, df = 0.0, 0
  for seeds in panels.values():
    x = [s.primary for s in seeds.values() if s.primary is not None]
    if len(x) >= 2:
      m = sum(x) / len(x)
      ss += sum((v - m) ** 2 for v in x)
      df += len(x) - 1
  if not df:
    raise ValueError("planning_from: no cell with >= 2 scored seeds")
  sd = math.sqrt(ss / df)
  clean = [s.primary - s.start for s in panels.get(CLEAN, {}).values()
           if s.primary is not None and s.start is not None]
  gain = sum(clean) / len(clean) if clean else math.nan
  return {"sd_within": sd, "df": df, "sd_diff": math.sqrt(2.0) * sd, "clean_gain": gain, "delta": gain / 2}
