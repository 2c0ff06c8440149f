"""A study's pre-registered protocol: primary metric, contrasts or selection rule, tests; per-run scores.

Declared in code beside the study (`rl_jax/study/studies.py`) and committed before its runs; the
runner stamps every run with the commit it ran at and this protocol's hash (`Protocol.digest`), and
the analysis (`rl_jax/study/verdicts.py`) refuses to pool cells that differ in either.

Per run (docs/results.md#protocol):
- primary metric: mean held-out greedy accuracy over the last `last_k` scheduled evaluations
  (`window='last_k'`) or over every scheduled evaluation in the second half of training, steps in
  (S/2, S] (`window='second_half'`), on an eval set of >= `min_eval_size` prompts. An evaluation
  a run did not reach because it aborted on a non-finite loss counts as `missing_after_abort`
  (0: a diverged policy answers nothing). A run that neither finished nor aborted has no score and is left out, named.
- outcome: 'never learned' if the best evaluation never exceeded the warm start's (step 0) by
  `collapse_margin`; else 'declined' if the primary metric ended below the warm start's; else
  'learned'. (Descriptive only: 'declined' is not a collapse. Until issue 53 this class was named
  'collapsed'; the project's one collapse is the event below.)
- collapse event (when the protocol declares `collapse_floor`): the first scheduled evaluation after
  step `collapse_after` at or below the floor, or an abort on a non-finite loss (at its step); a
  second primary endpoint, compared across paired arms with the exact McNemar test. It is the
  project's one definition of a collapse (`rl_jax.analysis.aggregate.collapse_step`, floor 0.005
  after step 20), which every table and figure uses.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from typing import Any, Sequence

from rl_jax.analysis import aggregate
from rl_jax.analysis.runs import Run

ACCURACY = "eval_greedy_accuracy"
TRAIN_ACCURACY = "accuracy"
KL = "mismatch/kl_k1"
ROUTING = "mismatch/routing_agreement"
OUTCOMES = ("learned", "declined", "never learned")
WINDOWS = ("last_k", "second_half")
# Fields added after protocols were published: left out of `as_dict` (and so of the digest) at these
# defaults, so that an earlier study's digest, recorded by its runs, stays what it was.
_LATER_FIELDS = {"window": "last_k", "collapse_floor": None, "collapse_after": 20}


@dataclasses.dataclass(frozen=True)
class Contrast:
  """Line `a` against line `b` in panel `panel`, paired over seeds; two-sided."""
  panel: str
  a: str
  b: str
  question: str = ""

  @property
  def name(self) -> str:
    return f"{self.panel}: {self.a} vs {self.b}"


@dataclasses.dataclass(frozen=True)
class Planning:
  """What the power statement assumes: the paired s.d. of the primary metric's differences and the
  effect size of interest, with where each came from (a calibration's numbers)."""
  sd_diff: float
  delta: float
  source: str


@dataclasses.dataclass(frozen=True)
class Protocol:
  """The pre-registered analysis of one study (module docstring).

  A study has `contrasts` (each tested with a paired t-test and an exact Wilcoxon signed-rank test,
  Holm-corrected over the study's contrasts at `alpha`; with `collapse_floor`, also the collapse
  event's exact McNemar test, Holm-corrected over the contrasts within that endpoint), or a
  selection `rule` (a calibration: a name in `rl_jax.study.rules.RULES`, read mechanically off
  the per-seed table), or both.
  `extra_seeds` states the only way seeds may be added after the runs: 'none' (the count is
  fixed), or a rule that applies to every line alike.
  """
  contrasts: tuple[Contrast, ...] = ()
  rule: str = ""
  metric: str = ACCURACY
  last_k: int = 3
  min_eval_size: int = 1024
  alpha: float = 0.05
  collapse_margin: float = 0.05
  missing_after_abort: float = 0.0
  extra_seeds: str = "none"
  planning: Planning | None = None
  window: str = "last_k"
  collapse_floor: float | None = None
  collapse_after: int = 20

  def __post_init__(self):
    if self.window not in WINDOWS:
      raise ValueError(f"protocol.window must be one of {WINDOWS}, got {self.window!r}")
    if self.collapse_floor is not None and not 0 <= self.collapse_floor < 1:
      raise ValueError(f"protocol.collapse_floor must be in [0, 1), got {self.collapse_floor}")
    if self.last_k < 1:
      raise ValueError(f"protocol.last_k must be >= 1, got {self.last_k}")
    if not 0 < self.alpha < 1:
      raise ValueError(f"protocol.alpha must be in (0, 1), got {self.alpha}")
    if not self.contrasts and not self.rule:
      raise ValueError("a protocol needs contrasts or a selection rule")
    names = [c.name for c in self.contrasts]
    if len(set(names)) != len(names):
      raise ValueError(f"protocol: duplicate contrasts in {names}")

  def as_dict(self) -> dict:
    d = dataclasses.asdict(self)
    for k, default in _LATER_FIELDS.items():
      if d[k] == default:
        del d[k]
    return d

  def window_steps(self, steps: int, eval_every: int) -> list[int]:
    """The scheduled evaluations the primary metric averages."""
    schedule = eval_schedule(steps, eval_every)
    if self.window == "second_half":
      return [s for s in schedule if 2 * s > steps]
    return schedule[-self.last_k:]

  def describe_metric(self) -> str:
    where = (f"over every scheduled evaluation in the second half of training (steps in (S/2, S])"
             if self.window == "second_half" else f"over the last {self.last_k} scheduled evaluations")
    return f"mean `{self.metric}` {where}"

  def describe_collapse(self) -> str:
    return (f"collapse event: an evaluation after step {self.collapse_after} with `{self.metric}` <= "
            f"{self.collapse_floor:g}, or an abort on a non-finite loss")

  def digest(self, study_definition: dict) -> str:
    """sha256 (16 hex digits) of this protocol and the study definition it analyses (every run's
    overrides, seeds, steps, base config): any change to either is another protocol."""
    blob = json.dumps({"protocol": self.as_dict(), "study": study_definition}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class RunScore:
  """One run's row of the per-seed table."""
  panel: str
  line: str
  seed: int
  primary: float | None
  start: float | None
  peak: float | None
  outcome: str | None
  aborted_step: int | None
  first_train_accuracy: float | None
  mean_kl: float | None
  mean_routing_agreement: float | None
  evals: tuple[tuple[int, float], ...]
  commit: str
  protocol: str
  note: str = ""
  # The collapse event's step (None: no event), `floor_event`: at the protocol's collapse_floor, or at
  # the one definition's floor (`aggregate.COLLAPSE_FLOOR`) where the protocol declares none, which
  # reports it per run but tests it in no contrast.
  collapse_step: int | None = None
  # `environment_key` of the run's run.json ('' for a run that recorded none): runs of one commit on
  # machines or package builds that compute differently are not bit-identical (docs/results.md).
  environment: str = ""

  def as_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d["evals"] = [list(e) for e in self.evals]
    return d


def eval_schedule(steps: int, eval_every: int) -> list[int]:
  """The steps the trainer evaluates at after step 0: every `eval_every`, and the last step."""
  out = list(range(eval_every, steps + 1, eval_every))
  if not out or out[-1] != steps:
    out.append(steps)
  return out


def floor_event(evals: dict[int, float], aborted_step: int | None, floor: float, after: int) -> int | None:
  """The step of the first evaluation after step `after` at or below `floor`, the abort step of an
  aborted run when no evaluation before it got there, or None: `aggregate.collapse_step`, the one
  definition (a non-finite evaluation counts as at the floor)."""
  steps = sorted(evals)
  return aggregate.collapse_step(steps, [evals[s] for s in steps], floor, after, aborted_step)


def _mean(values: Sequence[float]) -> float | None:
  x = [v for v in values if v is not None and math.isfinite(v)]
  return sum(x) / len(x) if x else None


def score_run(run: Run, protocol: Protocol, steps: int, eval_every: int, eval_size: int, panel: str = "",
              line: str = "", seed: int | None = None) -> RunScore:
  """The run's primary metric and outcome (module docstring); `primary` None when it has none yet.

  `panel` / `line` / `seed` label the row (default: the run's study.json)."""
  if eval_size < protocol.min_eval_size:
    raise ValueError(f"{run.workdir}: rl.eval_size={eval_size} < the protocol's min_eval_size="
                     f"{protocol.min_eval_size}")
  ev_steps, ev_values = run.series(protocol.metric)
  evals = dict(zip(ev_steps, ev_values))
  aborted = run.aborted_step
  schedule = protocol.window_steps(steps, eval_every)
  primary, note = None, ""
  if all(s in evals for s in schedule):
    primary = _mean([evals[s] for s in schedule])
  elif aborted is not None:
    vals = [evals.get(s, protocol.missing_after_abort) if s < aborted else protocol.missing_after_abort
            for s in schedule]
    primary = sum(vals) / len(vals)
    note = f"aborted (non-finite) at step {aborted}: later evaluations count {protocol.missing_after_abort:g}"
  else:
    note = f"unfinished: last logged step {run.last_step} of {steps}"
  if primary is not None and not math.isfinite(primary):
    primary, note = protocol.missing_after_abort, "non-finite evaluation counted as " \
        f"{protocol.missing_after_abort:g}"
  start = evals.get(0)
  finite = [v for v in ev_values if math.isfinite(v)]
  peak = max(finite) if finite else None
  outcome = None
  if primary is not None and start is not None and peak is not None:
    if peak < start + protocol.collapse_margin:
      outcome = "never learned"
    elif primary < start:
      outcome = "declined"
    else:
      outcome = "learned"
  tr_steps, tr_acc = run.series(TRAIN_ACCURACY)
  first = tr_acc[tr_steps.index(min(tr_steps))] if tr_steps else None
  study = run.study or {}
  floor = aggregate.COLLAPSE_FLOOR if protocol.collapse_floor is None else protocol.collapse_floor
  collapse_step = floor_event(evals, aborted, floor, protocol.collapse_after)
  return RunScore(panel=panel or study.get("panel", ""), line=line or study.get("line", ""),
                  seed=int(run.seed or 0) if seed is None else seed,
                  primary=primary, start=start, peak=peak, outcome=outcome, aborted_step=aborted,
                  first_train_accuracy=first, mean_kl=_mean(run.series(KL)[1]),
                  mean_routing_agreement=_mean(run.series(ROUTING)[1]),
                  evals=tuple(sorted(evals.items())), commit=str(study.get("commit", "unknown")),
                  protocol=str(study.get("protocol", "")), note=note, collapse_step=collapse_step)


def study_definition(study: Any) -> dict:
  """What a protocol's digest covers of its study: base, seeds, steps and every run's overrides."""
  return {"name": study.name, "base": study.base, "seeds": study.seeds, "steps": study.steps,
          "runs": {r.name: r.overrides for r in study.runs()}}


def environment_key(run_record: dict | None) -> str:
  """A short key of the environments a run ran under (`run.json`: its `environment` and any a resume
  recorded in its history, '|'-joined), '' when it recorded none."""
  if not run_record:
    return ""
  envs = [run_record.get("environment")] + [h.get("environment") for h in run_record.get("history", [])]
  keys = [hashlib.sha256(json.dumps(e, sort_keys=True).encode()).hexdigest()[:12] for e in envs if e]
  return "|".join(dict.fromkeys(keys))
