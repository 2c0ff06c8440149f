"""A study's verdicts under its pre-registered protocol: per-seed table, paired contrasts with Holm, rules, power.

Reads the runs a study's plan names, scores each (`protocol.score_run`), refuses to pool runs
whose commit or protocol digest differ (unless `allow_mixed`, and the report then says so),
and writes ROOT/per_seed.{csv,json}, ROOT/contrasts.json and ROOT/protocol.json.
"""
from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
from typing import Any, Sequence

from rl_jax import artifacts
from rl_jax.analysis import runs as runs_lib
from rl_jax.study import protocol as protocol_lib
from rl_jax.study import rules as rules_lib
from rl_jax.study import stats
from rl_jax.study.protocol import Protocol, RunScore


class MixedRunsError(ValueError):
  """Cells of one contrast (or rule) ran at different commits or under different protocols."""


@dataclasses.dataclass
class ContrastResult:
  contrast: protocol_lib.Contrast
  test: stats.PairedTest | None
  p_holm: float
  p_holm_wilcoxon: float
  verdict: str
  power: float | None = None
  min_detectable: float | None = None
  # The collapse endpoint (protocol.collapse_floor declared): its counts, Holm p and verdict.
  collapse: stats.PairedEvents | None = None
  collapse_p_holm: float | None = None
  collapse_verdict: str = ""

  def as_dict(self) -> dict:
    return {"contrast": dataclasses.asdict(self.contrast), "name": self.contrast.name,
            "test": self.test.as_dict() if self.test else None, "p_holm": self.p_holm,
            "p_holm_wilcoxon": self.p_holm_wilcoxon, "verdict": self.verdict, "power": self.power,
            "min_detectable_80": self.min_detectable,
            "collapse": self.collapse.as_dict() if self.collapse else None,
            "collapse_p_holm": self.collapse_p_holm, "collapse_verdict": self.collapse_verdict}


@dataclasses.dataclass
class Analysis:
  protocol: Protocol
  digest: str
  scores: list[RunScore]
  unscored: list[str]
  contrasts: list[ContrastResult]
  rule: tuple[str, str, dict] | None
  mixed: list[str]


def _check_uniform(label: str, scores: Sequence[RunScore], digest: str) -> list[str]:
  """Problems that forbid pooling `scores`: several commits or recorded environments, a dirty or
  other-protocol run."""
  problems = []
  commits = sorted({s.commit for s in scores})
  if len(commits) > 1:
    problems.append(f"{label}: runs at {len(commits)} commits ({', '.join(commits)})")
  dirty = sorted({f"{s.panel}/{s.line}/seed{s.seed}" for s in scores if s.commit.endswith("+dirty")})
  if dirty:
    problems.append(f"{label}: runs from a tree with uncommitted changes: {', '.join(dirty)}")
  envs = sorted({s.environment for s in scores if s.environment})
  if len(envs) > 1:
    problems.append(f"{label}: runs under {len(envs)} environments ({', '.join(envs)}; run.json's "
                    "'environment': CPU, packages, XLA flags)")
  other = sorted({f"{s.panel}/{s.line}/seed{s.seed}" for s in scores if s.protocol != digest})
  if other:
    problems.append(f"{label}: runs under another protocol than {digest}: {', '.join(other)}")
  return problems


def power_of(protocol: Protocol, n: int) -> tuple[float | None, float | None]:
  """(power at the planned effect, the difference detectable with 80% power) at n paired seeds."""
  pl = protocol.planning
  if pl is None or n < 2:
    return None, None
  return stats.power(n, pl.sd_diff, pl.delta, protocol.alpha), stats.min_detectable(n, pl.sd_diff,
                                                                                  protocol.alpha)


def analyze(study: Any, scores: list[RunScore], unscored: list[str], allow_mixed: bool = False) -> Analysis:
  """Contrasts (paired t + exact Wilcoxon signed-rank, Holm over the study's contrasts) and the selection rule."""
  proto: Protocol = study.protocol
  digest = proto.digest(protocol_lib.study_definition(study))
  scored = [s for s in scores if s.primary is not None]
  mixed: list[str] = []
  results: list[ContrastResult] = []
  tests: list[stats.PairedTest | None] = []
  for c in proto.contrasts:
    a = {s.seed: s.primary for s in scored if s.panel == c.panel and s.line == c.a}
    b = {s.seed: s.primary for s in scored if s.panel == c.panel and s.line == c.b}
    cells = [s for s in scored if s.panel == c.panel and s.line in (c.a, c.b)]
    mixed += _check_uniform(c.name, cells, digest)
    common = sorted(set(a) & set(b))
    tests.append(stats.paired_test(a, b, proto.alpha) if len(common) >= 2 else None)
  if proto.rule:
    mixed += _check_uniform(f"rule {proto.rule}", scored, digest)
  if mixed and not allow_mixed:
    raise MixedRunsError("refusing to aggregate (pass --allow_mixed to override; the verdict then says so):\n  "
                         + "\n  ".join(mixed))
  events = [_collapse_events(c, scored) for c in proto.contrasts] if proto.collapse_floor is not None else []
  p_c = iter(stats.holm([e.p for e in events if e is not None]))
  p_t = stats.holm([t.p_t for t in tests if t is not None])
  p_w = stats.holm([t.p_wilcoxon for t in tests if t is not None])
  it_t, it_w = iter(p_t), iter(p_w)
  for c, t in zip(proto.contrasts, tests):
    if t is None:
      results.append(ContrastResult(c, None, math.nan, math.nan, "not tested: fewer than 2 paired seeds"))
      continue
    ph, pw = next(it_t), next(it_w)
    pw_, mde = power_of(proto, t.n)
    results.append(ContrastResult(c, t, ph, pw, stats.verdict(c.a, c.b, t, ph, pw, proto.alpha), pw_, mde))
  for r, e in zip(results, events):
    if e is not None:
      r.collapse, r.collapse_p_holm = e, next(p_c)
      r.collapse_verdict = stats.event_verdict(r.contrast.a, r.contrast.b, e, r.collapse_p_holm, proto.alpha)
  rule = rules_lib.RULES[proto.rule](scored) if proto.rule else None
  return Analysis(protocol=proto, digest=digest, scores=scores, unscored=unscored, contrasts=results,
                  rule=rule, mixed=mixed)


def _collapse_events(c: protocol_lib.Contrast, scored: Sequence[RunScore]) -> stats.PairedEvents | None:
  """The contrast's collapse events over the seeds both arms have a score for (None below 2 seeds)."""
  a = {s.seed: s.collapse_step is not None for s in scored if s.panel == c.panel and s.line == c.a}
  b = {s.seed: s.collapse_step is not None for s in scored if s.panel == c.panel and s.line == c.b}
  return stats.paired_events(a, b) if len(set(a) & set(b)) >= 2 else None


PER_SEED_COLUMNS = ("panel", "line", "seed", "primary", "start", "peak", "outcome", "aborted_step",
                    "first_train_accuracy", "mean_kl", "mean_routing_agreement", "commit", "protocol", "note",
                    "collapse_step")


def write(analysis: Analysis, root: str) -> dict[str, str]:
  """ROOT/per_seed.{csv,json}, ROOT/contrasts.json, ROOT/protocol.json; returns their paths."""
  paths = {k: os.path.join(root, f) for k, f in (("per_seed_csv", "per_seed.csv"), ("per_seed_json", "per_seed.json"),
                                                 ("contrasts", "contrasts.json"), ("protocol", "protocol.json"))}
  with open(paths["per_seed_csv"], "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(PER_SEED_COLUMNS + ("evals",))
    for s in analysis.scores:
      d = s.as_dict()
      w.writerow([d[k] for k in PER_SEED_COLUMNS] + [" ".join(f"{st}:{v:.4f}" for st, v in s.evals)])
  with open(paths["per_seed_json"], "w") as f:
    json.dump([s.as_dict() for s in analysis.scores], f, indent=1)
  with open(paths["contrasts"], "w") as f:
    json.dump({"contrasts": [r.as_dict() for r in analysis.contrasts],
               "rule": None if analysis.rule is None else {"name": analysis.protocol.rule,
                                                             "decision": analysis.rule[2]},
               "mixed": analysis.mixed}, f, indent=1, default=_json_default)
  with open(paths["protocol"], "w") as f:
    json.dump({"digest": analysis.digest, **analysis.protocol.as_dict()}, f, indent=1)
  return paths


def _json_default(x):
  return None if isinstance(x, float) and not math.isfinite(x) else str(x)


def _fmt(x, spec=".3f") -> str:
  return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def markdown(analysis: Analysis) -> str:
  """The protocol, the mechanical verdicts and the per-seed table, for verdict.md."""
  p = analysis.protocol
  out = ["## Protocol (pre-registered)", "",
         f"Digest `{analysis.digest}` (rl_jax/study/protocol.py; every run records it with its commit). "
         f"Primary metric: {p.describe_metric()} on >= "
         f"{p.min_eval_size} held-out prompts; evaluations an aborted run did not reach count "
         f"{p.missing_after_abort:g}. Outcome per run: never learned (best evaluation < warm start + "
         f"{p.collapse_margin:g}), declined (learned, then ended below the warm start; descriptive, not a collapse), learned. "
         f"Extra seeds: {p.extra_seeds}." + (f" Second primary endpoint, the {p.describe_collapse()}: per "
                                             f"contrast the {stats.MCNEMAR_METHOD}, Holm over the contrasts."
                                             if p.collapse_floor is not None else ""), ""]
  if p.contrasts:
    out += [f"Contrasts: paired over seeds, two-sided paired t-test and {stats.WILCOXON_METHOD}, "
            f"{100 * (1 - p.alpha):.0f}% t interval of the mean paired difference, Holm correction over the "
            f"{len(p.contrasts)} contrasts at alpha = {p.alpha:g}; a verdict is a direction when the "
            "Holm-corrected t-test p < alpha, else a null."]
    if p.planning:
      out += ["", f"Power: from a paired s.d. of {p.planning.sd_diff:.3f} ({p.planning.source}); effect of "
              f"interest {p.planning.delta:.3f}."]
    out += ["", "## Contrasts", "", "| contrast | question | n | mean diff | 95% CI | p (t) | p (exact Wilcoxon) | "
            "Holm p (t) | Holm p (W) | power at the planned effect | 80%-power detectable diff | verdict |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    pf = lambda x: stats.format_p(x, p.alpha)
    for r in analysis.contrasts:
      t = r.test
      if t is None:
        out.append(f"| {r.contrast.name} | {r.contrast.question} | - | - | - | - | - | - | - | - | - | {r.verdict} |")
        continue
      out.append(f"| {r.contrast.name} | {r.contrast.question} | {t.n} | {t.mean:+.3f} | [{t.ci[0]:+.3f}, "
                 f"{t.ci[1]:+.3f}] | {pf(t.p_t)} | {pf(t.p_wilcoxon)} | {pf(r.p_holm)} | {pf(r.p_holm_wilcoxon)} | "
                 f"{_fmt(r.power, '.2f')} | {_fmt(r.min_detectable)} | {r.verdict} |")
    out += ["", "Verdicts (mechanical):", ""] + [f"- {r.contrast.name}: {r.verdict}" for r in analysis.contrasts]
    if p.collapse_floor is not None:
      out += ["", "## Collapse endpoint", "", f"The {p.describe_collapse()}; {stats.MCNEMAR_METHOD}.", "",
              "| contrast | n | A collapsed | B collapsed | A only | B only | p (McNemar) | Holm p | verdict |",
              "|---|---|---|---|---|---|---|---|---|"]
      for r in analysis.contrasts:
        e = r.collapse
        out.append(f"| {r.contrast.name} | - | - | - | - | - | - | - | not tested: fewer than 2 paired seeds |"
                   if e is None else
                   f"| {r.contrast.name} | {e.n} | {e.a_events} | {e.b_events} | {e.a_only} | {e.b_only} | "
                   f"{pf(e.p)} | {pf(r.collapse_p_holm)} | {r.collapse_verdict} |")
  if analysis.rule is not None:
    table, text, _ = analysis.rule
    out += ["", f"## Selection rule `{p.rule}` (pre-registered, rl_jax/study/rules.py)", "", table, text]
  if analysis.mixed:
    out += ["", "**Pooled despite differences (--allow_mixed):**", ""] + [f"- {m}" for m in analysis.mixed]
  if analysis.unscored:
    out += ["", f"Not scored ({len(analysis.unscored)}): " + ", ".join(analysis.unscored)]
  out += ["", "## Per seed", "", "| panel | line | seed | primary | warm start | peak | outcome | first-step "
          "train acc | mean KL k1 | commit |", "|---|---|---|---|---|---|---|---|---|---|"]
  for s in sorted(analysis.scores, key=lambda s: (s.panel, s.line, s.seed)):
    floor = "" if s.collapse_step is None else f"; collapsed at step {s.collapse_step}"
    out.append(f"| {s.panel} | {s.line} | {s.seed} | {_fmt(s.primary)} | {_fmt(s.start)} | {_fmt(s.peak)} | "
               f"{s.outcome or s.note or '-'}{floor} | {_fmt(s.first_train_accuracy)} | {_fmt(s.mean_kl, '.2g')} | "
               f"{s.commit[:12]} |")
  return "\n".join(out) + "\n"


def score_launches(launches: Sequence[Any], proto: Protocol) -> tuple[list[RunScore], list[str]]:
  """RunScores of the study's launches (a run without a primary metric yet is named in the second list)."""
  scores, unscored = [], []
  for launch in launches:
    run = runs_lib.load_run(launch.workdir, name=launch.name)
    label = f"{launch.name}/seed{launch.seed}"
    if not run.rows:
      unscored.append(f"{label} (no metrics)")
      continue
    s = protocol_lib.score_run(run, proto, steps=launch.steps, eval_every=launch.eval_every,
                               eval_size=launch.eval_size, panel=launch.run.panel, line=launch.run.line,
                               seed=launch.seed)
    record = artifacts.read_json(os.path.join(launch.workdir, artifacts.RUN))
    s = dataclasses.replace(s, environment=protocol_lib.environment_key(record))
    if s.primary is None:
      unscored.append(f"{label} ({s.note})")
    scores.append(s)
  return scores, unscored
