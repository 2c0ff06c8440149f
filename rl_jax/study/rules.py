"""Selection rules of the calibration studies, read mechanically off the per-seed table (pure functions).

Each rule takes the study's RunScores and returns (markdown table, decision text, decision dict).
They are fixed in code before the calibration they read runs (rl_jax/study/studies.py names them).
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

from rl_jax.analysis import aggregate
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
  among those where every seed learned (none declined, aborted or never learned); an lr within
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


# -- `dose_response` (issue 37 step 3, fixed before the calibration's runs) -------------------------
# Panels `clean` and `<source>_<dose>` (async_4, noise_0.2, bf16_fp8, stale_16, ...), lines `pg` and
# `sc`. Every quantity is read at the ladder's own last 3 evaluations (the clean arm runs longer, to
# show where learning plateaus, but is compared over the same window as the others).
DOSE_PG, DOSE_SC = "pg", "sc"
# (a) The clean arm gains clearly: clean PG's mean gain over the warm start >= this, on every seed > 0.
CLEAR_GAIN = 0.05
# (b) PG under the mismatch first learns (peak >= warm start + LEARN_MARGIN) and then fails (an
# evaluation after the peak at or below COLLAPSE_FLOOR, an abort, or a window mean below the warm
# start) on at least FAIL_SHARE of its seeds.
LEARN_MARGIN = 0.05
COLLAPSE_FLOOR = aggregate.COLLAPSE_FLOOR   # 0.005, the collapse endpoint's floor
FAIL_SHARE = 1 / 3
# (c) The sampler is not broken at step 0: PG's mean first-step train accuracy (the reward's
# success rate) >= this share of clean PG's.
DOSE_FIRST_STEP_SHARE = 0.8
# Plateau: the first evaluation whose trailing mean of 3 evaluations (mean curve over seeds) comes
# within PLATEAU_TOL of that curve's maximum; reached in the last 3 evaluations = still rising.
PLATEAU_TOL = 0.01


def _evals(s: RunScore) -> dict[int, float]:
  return dict(s.evals)


def ladder_window(scores: Sequence[RunScore]) -> list[int]:
  """The last 3 evaluation steps of the ladder (every panel but the clean one)."""
  last = [max(_evals(s)) for s in scores if s.panel != CLEAN and s.evals]
  if not last:
    raise ValueError("rule 'dose_response': no ladder run has evaluations")
  end = min(last)
  steps = sorted({st for s in scores if s.panel != CLEAN for st in _evals(s) if st <= end})
  return steps[-3:]


def window_mean(s: RunScore, window: Sequence[int]) -> float | None:
  ev = _evals(s)
  if s.aborted_step is not None:
    return _mean([ev.get(w, 0.0) if w < s.aborted_step else 0.0 for w in window])
  if not all(w in ev for w in window):
    return None
  return sum(ev[w] for w in window) / len(window)


def learned_then_failed(s: RunScore, window: Sequence[int]) -> bool:
  """(b) for one run: its peak evaluation (after step 0, up to the window's end) reached warm start +
  LEARN_MARGIN, and afterwards it aborted, fell to <= COLLAPSE_FLOOR, or ended below the warm start."""
  ev = {k: v for k, v in _evals(s).items() if 0 < k <= window[-1]}
  if s.start is None or not ev:
    return False
  peak_step = max(ev, key=lambda k: (ev[k], -k))
  if ev[peak_step] < s.start + LEARN_MARGIN:
    return False
  after = [v for k, v in ev.items() if k > peak_step]
  end = window_mean(s, window)
  return (s.aborted_step is not None or any(v <= COLLAPSE_FLOOR for v in after)
          or (end is not None and end < s.start))


def collapsed(s: RunScore) -> bool:
  """The collapse endpoint (`aggregate.collapse_step`, the one definition): an evaluation after step
  20 at or below COLLAPSE_FLOOR, or an abort. Descriptive here: the rule's (b) reads
  `learned_then_failed`, not this."""
  ev = _evals(s)
  steps = sorted(ev)
  return aggregate.collapse_step(steps, [ev[k] for k in steps], aborted_step=s.aborted_step) is not None


def plateau_step(runs: Sequence[RunScore]) -> tuple[int | None, bool]:
  """(plateau step, still rising?) of the runs' mean held-out curve (PLATEAU_TOL; module comment)."""
  common = sorted(set.intersection(*(set(_evals(s)) for s in runs))) if runs else []
  common = [k for k in common if k > 0]
  if len(common) < 3:
    return None, True
  curve = [sum(_evals(s)[k] for s in runs) / len(runs) for k in common]
  trail = [sum(curve[i - 2:i + 1]) / 3 for i in range(2, len(curve))]
  top = max(trail)
  i = next(i for i, v in enumerate(trail) if v >= top - PLATEAU_TOL)
  return common[i + 2], i + 2 >= len(common) - 3


def dose_response(scores: Sequence[RunScore]) -> tuple[str, str, dict]:
  """The regime(s) for issue 37's contrasts, read off the dose-response ladder (module comments).

  A regime qualifies when (a) the clean arm gains clearly, (b) PG learns then fails on >= FAIL_SHARE
  of its seeds and (c) its sampler is not broken at step 0. Only PG and the clean arm decide; SC's
  runs give the paired s.d. and the plateau. Chosen: the qualifying regime with the smallest mean
  KL k1 (the mildest mismatch that does it); also named, per source, its smallest qualifying dose."""
  panels: dict[str, dict[str, dict[int, RunScore]]] = {}
  for s in scores:
    panels.setdefault(s.panel, {}).setdefault(s.line, {})[s.seed] = s
  if CLEAN not in panels or DOSE_PG not in panels[CLEAN]:
    raise ValueError(f"rule 'dose_response' needs a '{CLEAN}' panel with a '{DOSE_PG}' line; panels: {sorted(panels)}")
  window = ladder_window(scores)
  clean = panels[CLEAN][DOSE_PG]
  clean_gain = {k: (window_mean(s, window) or 0.0) - s.start for k, s in clean.items() if s.start is not None}
  gains_ok = bool(clean_gain) and _mean(clean_gain.values()) >= CLEAR_GAIN and all(g > 0 for g in clean_gain.values())
  clean_first = _mean(s.first_train_accuracy for s in clean.values())
  rows, qualifying = [], {}
  for panel, lines in panels.items():
    pg = lines.get(DOSE_PG, {})
    cells = []
    for line in (DOSE_PG, DOSE_SC):
      runs = lines.get(line, {})
      wm = _mean(window_mean(s, window) for s in runs.values())
      fails = sum(learned_then_failed(s, window) for s in runs.values())
      zero = sum(collapsed(s) for s in runs.values())
      cells.append(f"{_f(wm)} ({fails}/{len(runs)}, {zero}/{len(runs)})")
    fail_pg = sum(learned_then_failed(s, window) for s in pg.values())
    first = _mean(s.first_train_accuracy for s in pg.values())
    first_share = first / clean_first if first is not None and clean_first else None
    kl = _mean(s.mean_kl for s in pg.values())
    ok_b = bool(pg) and fail_pg >= FAIL_SHARE * len(pg) - 1e-9
    ok_c = first_share is not None and first_share >= DOSE_FIRST_STEP_SHARE
    ok = panel != CLEAN and gains_ok and ok_b and ok_c
    if ok:
      qualifying[panel] = kl if kl is not None else math.inf
    verdict = "reference" if panel == CLEAN else ("**qualifies**" if ok else "no" + (
        "" if ok_c else " (broken at step 0)"))
    rows.append(f"| {panel} | {cells[0]} | {cells[1]} | {_f(first)} ({_f(first_share, 2)}) | {_g(kl)} | {verdict} |")
  table = "\n".join([
      f"Window: evaluations at steps {', '.join(map(str, window))}. Clean PG gain per seed: "
      + ", ".join(f"{g:+.3f}" for _, g in sorted(clean_gain.items()))
      + f" ({'clear' if gains_ok else 'NOT clear'}: mean >= {CLEAR_GAIN:g}, every seed > 0).", "",
      "| regime | PG window mean (learned then failed, collapsed: eval <= floor after step 20 or abort) | SC likewise "
      "| PG first-step train acc "
      "(share of clean) | PG mean KL k1 | qualifies? |", "|---|---|---|---|---|---|", *rows]) + "\n"
  chosen = min(qualifying, key=qualifying.get) if qualifying else None
  per_source: dict[str, str] = {}
  for panel in sorted(qualifying, key=qualifying.get):
    per_source.setdefault(panel.rsplit("_", 1)[0], panel)
  decision: dict = {"regime": chosen, "qualifying": sorted(qualifying), "per_source": per_source,
                    "clean_gain_clear": gains_ok, "window": window}
  text = (f"Qualifying regimes: {', '.join(sorted(qualifying)) or 'none'}. Chosen: **{chosen or 'none'}**"
          + ("" if chosen else " (no regime where PG learns and then fails: the next step is a larger model or "
             "longer answers, not the contrasts)") + ".")
  if chosen:
    runs = panels[chosen]
    d = [window_mean(runs[DOSE_SC][k], window) - window_mean(runs[DOSE_PG][k], window)
         for k in sorted(set(runs.get(DOSE_SC, {})) & set(runs.get(DOSE_PG, {})))
         if window_mean(runs[DOSE_SC][k], window) is not None and window_mean(runs[DOSE_PG][k], window) is not None]
    if len(d) >= 2:
      m = sum(d) / len(d)
      decision["paired_sd_sc_pg"] = math.sqrt(sum((x - m) ** 2 for x in d) / (len(d) - 1))
      text += f" Paired s.d. of SC - PG there: {decision['paired_sd_sc_pg']:.3f} ({len(d)} seeds)."
    for name, runs_ in ((f"{chosen}/sc", runs.get(DOSE_SC, {})), (f"{chosen}/pg", runs.get(DOSE_PG, {})),
                        ("clean/pg", clean)):
      step, rising = plateau_step(list(runs_.values()))
      decision.setdefault("plateau", {})[name] = {"step": step, "still_rising": rising}
      text += (f" Plateau {name}: " + ("-" if step is None else f"step {step}")
               + (" (still rising)" if rising else "") + ".")
  return table, text, decision


# -- `pg_fails` (issue 53, calibration 3; fixed before its runs) -------------------------------------
# Panels `clean` (line `pg` only) and the mismatch cells; lines `pg`, `sc`, `tis`, `sc_tis`. Every
# quantity is the protocol's primary metric, the run's second-half mean (RunScore.primary), against
# its own warm start (step 0). ONLY the clean and the PG arms decide; SC, TIS and SC + TIS are
# reported beside them and read by no clause.
# (a) The clean arm gains clearly: mean gain >= CLEAR_GAIN and every seed's gain > 0.
# (b) PG's mean is below the clean arm's mean by more than DEFICIT_SDS x the clean arm's seed-to-seed
#     s.d. of the primary metric.
# (c) PG ends below its warm start (primary < start) on at least PG_BELOW_SHARE of its seeds.
# Chosen: among qualifying cells, the one with the LARGEST PG deficit (clean mean - PG mean).
DEFICIT_SDS = 2.0
PG_BELOW_SHARE = 2 / 3
FAIL_LINES = ("pg", "sc", "tis", "sc_tis")


def _sd(xs: Sequence[float]) -> float | None:
  if len(xs) < 2:
    return None
  m = sum(xs) / len(xs)
  return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def pg_fails(scores: Sequence[RunScore]) -> tuple[str, str, dict]:
  """The regime for issue 53's contrasts: where plain PG fails while the clean arm learns (module
  comments above; clauses (a)-(c) read only `clean/pg` and `<cell>/pg`)."""
  panels: dict[str, dict[str, dict[int, RunScore]]] = {}
  for s in scores:
    panels.setdefault(s.panel, {}).setdefault(s.line, {})[s.seed] = s
  if CLEAN not in panels or DOSE_PG not in panels[CLEAN]:
    raise ValueError(f"rule 'pg_fails' needs a '{CLEAN}' panel with a '{DOSE_PG}' line; panels: {sorted(panels)}")
  clean = [s for _, s in sorted(panels[CLEAN][DOSE_PG].items()) if s.primary is not None and s.start is not None]
  gains = [s.primary - s.start for s in clean]
  clean_mean = _mean([s.primary for s in clean])
  clean_sd = _sd([s.primary for s in clean])
  clear = bool(gains) and _mean(gains) >= CLEAR_GAIN and all(g > 0 for g in gains)
  rows, qualifying, per_cell = [], {}, {}
  for panel in sorted(p for p in panels if p != CLEAN):
    lines = panels[panel]
    pg = [s for _, s in sorted(lines.get(DOSE_PG, {}).items()) if s.primary is not None and s.start is not None]
    pg_mean = _mean([s.primary for s in pg])
    deficit = clean_mean - pg_mean if clean_mean is not None and pg_mean is not None else None
    below = sum(s.primary < s.start for s in pg)
    floor = sum(s.collapse_step is not None for s in pg)
    ok_b = deficit is not None and clean_sd is not None and deficit > DEFICIT_SDS * clean_sd
    ok_c = bool(pg) and below >= PG_BELOW_SHARE * len(pg) - 1e-9
    ok = clear and ok_b and ok_c
    if ok:
      qualifying[panel] = deficit
    others = []
    for line in FAIL_LINES[1:]:   # reported, never read by a clause
      runs = [s for s in lines.get(line, {}).values() if s.primary is not None]
      others.append(_f(_mean([s.primary for s in runs])) + f" ({len(runs)})")
    per_cell[panel] = {"pg_mean": pg_mean, "deficit": deficit, "pg_below_start": below, "pg_at_floor": floor,
                       "pg_seeds": len(pg), "kl": _mean(s.mean_kl for s in pg),
                       "routing_agreement": _mean(s.mean_routing_agreement for s in pg)}
    rows.append(f"| {panel} | {_f(pg_mean)} ({len(pg)}) | {_f(deficit)} | {below}/{len(pg)} | {floor}/{len(pg)} | "
                + " | ".join(others) + f" | {_g(per_cell[panel]['kl'])} | {_f(per_cell[panel]['routing_agreement'])} | "
                + ("**qualifies**" if ok else "no") + " |")
  bar = DEFICIT_SDS * clean_sd if clean_sd is not None else None
  table = "\n".join([
      f"Clean PG: second-half mean {_f(clean_mean)} over {len(clean)} seeds, seed-to-seed s.d. {_f(clean_sd)} "
      f"(clause (b) needs a PG deficit > {_f(bar)}); gain per seed "
      + ", ".join(f"{g:+.3f}" for g in gains) + f" ({'clear' if clear else 'NOT clear'}: mean >= {CLEAR_GAIN:g}, "
      "every seed > 0).", "",
      "| cell | PG mean (seeds) | PG deficit | PG below warm start | PG collapse events | SC mean | TIS mean "
      "| SC + TIS mean | PG mean KL k1 | PG routing agreement | qualifies? |",
      "|---|---|---|---|---|---|---|---|---|---|---|", *rows]) + "\n"
  chosen = max(qualifying, key=qualifying.get) if qualifying else None
  decision: dict = {"regime": chosen, "qualifying": sorted(qualifying), "clean_gain_clear": clear,
                    "clean_mean": clean_mean, "clean_sd": clean_sd, "cells": per_cell}
  text = (f"Qualifying cells: {', '.join(sorted(qualifying)) or 'none'}. Chosen (largest PG deficit): "
          f"**{chosen or 'none'}**.")
  step, rising = plateau_step(clean)
  decision["clean_plateau"] = {"step": step, "still_rising": rising}
  text += f" Clean PG's plateau: " + ("-" if step is None else f"step {step}") + (" (still rising)." if rising else ".")
  if chosen:   # what the contrasts' power statement needs; read by no clause
    runs = panels[chosen]
    for line in FAIL_LINES[1:]:
      d = [runs[line][k].primary - runs[DOSE_PG][k].primary
           for k in sorted(set(runs.get(line, {})) & set(runs.get(DOSE_PG, {})))
           if runs[line][k].primary is not None and runs[DOSE_PG][k].primary is not None]
      if len(d) >= 2:
        decision.setdefault("paired", {})[f"{line}-pg"] = {"mean": sum(d) / len(d), "sd": _sd(d), "n": len(d)}
        text += f" {line} - PG there: {sum(d) / len(d):+.3f}, paired s.d. {_sd(d):.3f} ({len(d)} seeds)."
  return table, text, decision


RULES: dict[str, Rule] = {"best_lr": best_lr, "bites": bites, "dose_response": dose_response,
                          "pg_fails": pg_fails}


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
