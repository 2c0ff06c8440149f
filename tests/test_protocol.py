"""The pre-registered study protocol: paired statistics, per-run scores, selection rules, the analysis."""
import json
import math
import os

import numpy as np
import pytest
from scipy import stats as sps

from rl_jax.analysis.runs import Run
from rl_jax.study import dose_figure, protocol, publish, rules, runner, stats, studies, verdicts
from rl_jax.study.protocol import Contrast, Planning, Protocol, RunScore


def test_paired_t_matches_the_closed_form():
  a = {0: 0.30, 1: 0.25, 2: 0.40, 3: 0.35, 4: 0.20}
  b = {0: 0.20, 1: 0.22, 2: 0.31, 3: 0.30, 4: 0.21, 9: 0.9}   # seed 9 is unpaired: ignored
  t = stats.paired_test(a, b, alpha=0.05)
  d = np.array([0.10, 0.03, 0.09, 0.05, -0.01])
  se = d.std(ddof=1) / math.sqrt(5)
  assert t.seeds == (0, 1, 2, 3, 4) and t.n == 5 and t.df == 4
  assert t.mean == pytest.approx(d.mean()) and t.se == pytest.approx(se)
  assert t.t == pytest.approx(d.mean() / se)
  assert t.p_t == pytest.approx(2 * (1 - sps.t.cdf(d.mean() / se, 4)))
  half = 2.7764451051977987 * se                      # t_{0.975, 4}
  assert t.ci == pytest.approx((d.mean() - half, d.mean() + half))
  # Wilcoxon, exact: ranks of |d| = [5, 2, 4, 3, 1], W- = 1 -> P(W <= 1) * 2 = 2 * 2 / 32.
  assert t.p_wilcoxon == pytest.approx(4 / 32)


def test_wilcoxon_exact_with_ties_and_a_zero_by_hand():
  # |d| = 0.01, 0.3, 0.3 (one of them 0.1 + 0.2 = 0.30000000000000004: a tie in float noise), 0.4, 0.5
  # and a zero (dropped) -> midranks 1, 2.5, 2.5, 4, 5; only 0.4 is negative: W- = 4. Of the 2^5 = 32
  # equally likely sign vectors, the subsets of {1, 2.5, 2.5, 4, 5} summing to <= 4 are {}, {1},
  # {2.5}, {2.5'}, {1, 2.5}, {1, 2.5'}, {4}: P(W- <= 4) = 7 / 32, two-sided p = 14 / 32.
  d = [0.01, 0.3, 0.1 + 0.2, -0.4, 0.5, 0.0]
  assert stats.wilcoxon_p(d) == pytest.approx(14 / 32, abs=1e-15)
  assert stats.wilcoxon_p([-x for x in d]) == pytest.approx(14 / 32, abs=1e-15)   # symmetric
  # One sign vector of 2^3 reaches the extreme on each side: p = 2 / 8.
  assert stats.wilcoxon_p([1.0, 2.0, 2.0]) == pytest.approx(2 / 8, abs=1e-15)
  assert stats.wilcoxon_p([0.0, 0.0]) == 1.0


def test_wilcoxon_exact_matches_enumerating_every_sign_flip_beyond_13_pairs():
  # n = 14 with ties (where SciPy's method='auto' switches to the normal approximation): the p-value
  # is the share of the 2^14 sign flips whose W+ is at least as extreme, counted directly.
  d = np.array([3, -1, 4, 1, -5, 9, 2, -6, 5, 3, 5, -8, 9, 7], np.float64) / 3072
  ranks = sps.rankdata(np.abs(d))
  signs = np.array(list(__import__("itertools").product((0, 1), repeat=d.size)), np.float64)
  w_all = np.round(2 * signs @ ranks).astype(int)
  w = int(round(2 * ranks[d > 0].sum()))
  want = min(1.0, 2 * min(np.mean(w_all <= w), np.mean(w_all >= w)))
  assert stats.wilcoxon_p(d) == pytest.approx(want, abs=1e-12)


def test_paired_test_edge_cases():
  with pytest.raises(ValueError, match=">= 2 seeds"):
    stats.paired_test({0: 1.0}, {0: 0.5, 1: 0.2})
  with pytest.raises(ValueError, match="not finite"):
    stats.paired_test({0: 1.0, 1: math.nan}, {0: 0.5, 1: 0.2})
  same = stats.paired_test({0: 0.3, 1: 0.4}, {0: 0.3, 1: 0.4})
  assert same.p_t == 1.0 and same.p_wilcoxon == 1.0 and same.mean == 0.0


def test_holm_step_down():
  # m = 4: sorted p 0.01, 0.02, 0.03, 0.5 -> 0.04, 0.06, 0.06 (monotone), 0.5 (capped by rank 1 x 0.5).
  assert stats.holm([0.03, 0.5, 0.01, 0.02]) == pytest.approx([0.06, 0.5, 0.04, 0.06])
  assert stats.holm([0.9, 0.8]) == pytest.approx([1.0, 1.0])


def test_format_p_reads_against_alpha_as_the_verdict_does():
  assert stats.format_p(0.00833) == "0.00833" and stats.format_p(1.0) == "1"
  assert stats.format_p(0.0499947754914689) == "0.04999"   # "0.05" would read as failing the threshold
  assert stats.format_p(0.0500004) == "0.0500004" and stats.format_p(0.05) == "0.05"
  assert stats.format_p(0.0999996, alpha=0.1) == "0.0999996"
  text = stats.verdict("a", "b", stats.paired_test({0: .3, 1: .5, 2: .4}, {0: .2, 1: .3, 2: .35}, 0.05),
                       0.0499947754914689, 0.0499947754914689, 0.05)
  assert text.startswith("**a > b**") and "Holm 0.04999)" in text, text


def test_power_and_detectable_difference():
  assert stats.power(10, 0.1, 0.0, 0.05) == pytest.approx(0.05, abs=1e-9)   # no effect: the test's size
  assert stats.power(10, 0.1, 0.05) < stats.power(20, 0.1, 0.05) < stats.power(20, 0.1, 0.1)
  mde = stats.min_detectable(10, 0.1)
  assert stats.power(10, 0.1, mde) == pytest.approx(0.8, abs=1e-6)
  n = stats.seeds_for_power(0.1, mde)
  assert n == 10


def _run(evals, train_acc=0.05, failed=None, seed=0, kl=1e-3):
  rows = [{"step": s, "eval_greedy_accuracy": v} for s, v in evals]
  by = {r["step"]: r for r in rows}
  for s in range(1, max(s for s, _ in evals) + 1):
    by.setdefault(s, {"step": s}).update({"reward": 0.0, "accuracy": train_acc if s == 1 else 0.5,
                                          "mismatch/kl_k1": kl})
  return Run(workdir=f"/x/seed{seed}", name="x", seed=seed, rows=[by[s] for s in sorted(by)], failed=failed,
             study={"panel": "p", "line": "l", "commit": "abc", "protocol": "d"})


def test_score_run_primary_metric_and_outcome():
  proto = Protocol(rule="best_lr", last_k=3)
  learned = protocol.score_run(_run([(0, 0.1), (20, 0.2), (40, 0.3), (60, 0.4), (80, 0.5)]), proto, 80, 20, 1024)
  assert learned.primary == pytest.approx(0.4) and learned.outcome == "learned"
  assert learned.start == 0.1 and learned.peak == 0.5 and learned.first_train_accuracy == 0.05
  assert protocol.eval_schedule(90, 20) == [20, 40, 60, 80, 90]
  # Learned, then ended below the warm start: 'declined' (descriptive; the one collapse is the floor event).
  declined = protocol.score_run(_run([(0, 0.1), (20, 0.3), (40, 0.05), (60, 0.0), (80, 0.01)]), proto, 80, 20, 1024)
  assert declined.outcome == "declined" and "collapsed" not in protocol.OUTCOMES
  flat = protocol.score_run(_run([(0, 0.1), (20, 0.12), (40, 0.11), (60, 0.1), (80, 0.13)]), proto, 80, 20, 1024)
  assert flat.outcome == "never learned"
  # Aborted on a non-finite loss at step 65: the evaluation at 60 counts, 80 (never reached) counts 0.
  ab = _run([(0, 0.1), (20, 0.3), (40, 0.3), (60, 0.3)], failed={"error": "FloatingPointError: non-finite loss"})
  ab.rows.append({"step": 64, "reward": 0.0})
  s = protocol.score_run(ab, proto, 80, 20, 1024)
  assert s.aborted_step == 65 and s.primary == pytest.approx((0.3 + 0.3 + 0.0) / 3)
  assert "aborted" in s.note
  unfinished = protocol.score_run(_run([(0, 0.1), (20, 0.3)]), proto, 80, 20, 1024)
  assert unfinished.primary is None and "unfinished" in unfinished.note
  with pytest.raises(ValueError, match="min_eval_size"):
    protocol.score_run(_run([(0, 0.1)]), proto, 80, 20, 256)


def _score(panel, seed, primary, start=0.05, first=0.05, kl=1e-3, route=None, outcome="learned", line="pg"):
  return RunScore(panel=panel, line=line, seed=seed, primary=primary, start=start, peak=max(primary, start) + 0.1,
                  outcome=outcome, aborted_step=None, first_train_accuracy=first, mean_kl=kl,
                  mean_routing_agreement=route, evals=(), commit="abc", protocol="d")


def test_rule_best_lr_prefers_the_smaller_of_tied_rates():
  scores = [_score("lr_0.01", s, 0.10) for s in (0, 1)] + [_score("lr_0.1", s, 0.305) for s in (0, 1)]
  scores += [_score("lr_0.3", s, 0.31) for s in (0, 1)]
  scores += [_score("lr_1", 0, 0.5), _score("lr_1", 1, 0.0, outcome="collapsed")]   # best mean, not stable
  _, text, decision = rules.best_lr(scores)
  assert decision["lr"] == 0.1 and "lr = 0.1" in text


def test_rule_bites_separates_drift_from_a_broken_sampler():
  clean = [_score("clean", s, 0.30) for s in (0, 1)]                       # gain 0.25 on each seed
  drift = [_score("noise_0.1", s, 0.10, kl=0.05, route=0.95) for s in (0, 1)]   # keeps 20%: bites
  mild = [_score("noise_0.05", 0, 0.10, kl=0.01), _score("noise_0.05", 1, 0.25, kl=0.01)]   # one seed keeps 80%
  broken = [_score("fp4", s, 0.05, first=0.01, kl=0.02, route=0.85) for s in (0, 1)]   # broken at step 0
  _, text, decision = rules.bites(clean + drift + mild + broken)
  assert decision["biting"] == ["noise_0.1"] and decision["regime"] == "noise_0.1"
  assert decision["routing_flip"] == "fp4"
  table, _, _ = rules.bites(clean + broken)
  assert "broken at step 0" in table


PROTO = Protocol(contrasts=(Contrast("n", "sc", "pg", "SC over PG"), Contrast("n", "tis", "pg")),
                 min_eval_size=8, planning=Planning(sd_diff=0.05, delta=0.05, source="test"))
STUDY = studies.Study(name="proto_micro", description="test", base="configs/countdown_tiny.py:test",
                      panels=(("n", {"rl.eval_size": 8, "rl.eval_every": 1}),),
                      lines=(("pg", {"loss.method": "pg"}), ("sc", {"loss.method": "pg"}),
                             ("tis", {"loss.method": "tis"})),
                      seeds=4, steps=3, protocol=PROTO)


class PrimaryExecutor:
  """A trainer stand-in: accuracy rises to a per-(line, seed) final value; records what it was run as."""

  FINAL = {"pg": 0.20, "sc": 0.30, "tis": 0.21}

  def __call__(self, launch, log_path):
    if launch.kind == "warm_start":
      return 0
    final = self.FINAL[launch.run.line] + 0.01 * launch.seed + (0.003 * launch.seed ** 2 if launch.run.line == "sc" else 0)
    with open(os.path.join(launch.workdir, "metrics.jsonl"), "w") as f:
      f.write(json.dumps({"step": 0, "eval_greedy_accuracy": 0.05}) + "\n")
      for s in range(1, launch.steps + 1):
        f.write(json.dumps({"step": s, "reward": 0.0, "accuracy": 0.05, "mismatch/kl_k1": 1e-3,
                            "eval_greedy_accuracy": final}) + "\n")
    with open(os.path.join(launch.workdir, "summary.json"), "w") as f:
      json.dump({"steps": launch.steps}, f)
    return 0


def test_protocol_study_end_to_end(tmp_path, monkeypatch):
  monkeypatch.setattr(runner, "code_version", lambda repo=None: "c0ffee")
  p = runner.plan(STUDY, str(tmp_path))
  assert p.protocol == PROTO.digest(protocol.study_definition(STUDY)) and not p.deviations
  text = runner.protocol_text(p)
  assert "contrast n: sc vs pg (SC over PG)" in text and "power at n = 4" in text
  runner.run_study(p, executor=PrimaryExecutor(), progress=False)
  info = json.load(open(tmp_path / "n/sc/seed0/study.json"))
  assert info["commit"] == "c0ffee" and info["protocol"] == p.protocol
  paths = runner.aggregate_study(p, "python -m rl_jax.study proto_micro")
  result = json.load(open(paths["contrasts"]))["contrasts"]
  sc = next(r for r in result if r["name"] == "n: sc vs pg")
  assert sc["test"]["n"] == 4 and sc["test"]["mean"] == pytest.approx(0.1 + 0.003 * np.mean([0, 1, 4, 9]))
  assert sc["verdict"].startswith("**sc > pg**")
  tis = next(r for r in result if r["name"] == "n: tis vs pg")
  # Every difference is exactly 0.01: no variance, p = 0 -> a direction; Holm keeps it below alpha.
  assert tis["test"]["mean"] == pytest.approx(0.01)
  per_seed = json.load(open(paths["per_seed_json"]))
  assert len(per_seed) == 12 and {r["commit"] for r in per_seed} == {"c0ffee"}
  assert os.path.exists(paths["per_seed_csv"]) and json.load(open(paths["protocol"]))["digest"] == p.protocol
  verdict = open(paths["verdict"]).read()
  assert "## Protocol (pre-registered)" in verdict and "Not yet written" not in verdict
  # A cell rerun at another commit cannot be pooled with the rest without --allow_mixed.
  info["commit"] = "beef"
  json.dump(info, open(tmp_path / "n/sc/seed0/study.json", "w"))
  with pytest.raises(verdicts.MixedRunsError, match="2 commits"):
    runner.aggregate_study(p)
  runner.aggregate_study(p, allow_mixed=True)
  assert "Pooled despite differences" in open(paths["verdict"]).read()
  # Fewer seeds than the protocol's is a deviation the verdict names.
  short = runner.plan(STUDY, str(tmp_path), seeds=3)
  assert short.deviations == ("--seeds 3 instead of the protocol's 4",)


def test_protocol_studies_are_declared_with_their_rules():
  for name in ("lr_sgd", "calibrate"):
    s = studies.get(name)
    assert s.protocol is not None and s.protocol.rule in rules.RULES and s.seeds >= 2 and s.steps >= 400
    for r in s.runs():
      o = r.overrides
      assert o["optim.name"] == "sgd" and o["optim.schedule"] == "constant" and o["rl.n_minibatches"] == 1
      assert o["advantage.reward_mode"] == "pm1" and o["advantage.mode"] == "group_centered"
      assert o["rl.eval_size"] >= s.protocol.min_eval_size
  assert "clean" in dict(studies.get("calibrate").panels)


def test_dose_response_study_is_declared_before_its_runs():
  s = studies.get("dose_response")
  assert s.protocol is not None and s.protocol.rule == "dose_response" and s.protocol.rule in rules.RULES
  assert s.base == studies.DOSE_BASE and s.seeds == 3 and s.steps == studies.RECIPE_STEPS
  panels = dict(s.panels)
  assert set(panels) == {"clean", "async_2", "async_4", "async_6", "async_8", "noise_0.15", "noise_0.2",
                         "noise_0.3", "bf16_fp8", "bf16_fp4kv", "stale_16", "stale_32"}
  assert [k for k, _ in s.lines] == ["pg", "sc"]
  by = {r.name: r.overrides for r in s.runs()}
  assert len(by) == 24
  for name, o in by.items():
    assert o["optim.name"] == "sgd" and o["optim.lr"] == studies.RECIPE_LR and o["rl.n_minibatches"] == 1
    assert o["advantage.reward_mode"] == "pm1" and o["rl.eval_size"] >= s.protocol.min_eval_size
    assert o["rl.steps"] == (studies.DOSE_CLEAN_STEPS if name.startswith("clean/") else studies.RECIPE_STEPS)
  assert by["async_6/sc"]["rl.mode"] == "async" and by["async_6/sc"]["rl.max_staleness"] == 6
  assert by["async_6/sc"]["sampler.quant"] == "none" and by["stale_16/pg"]["rl.staleness"] == 16
  assert by["noise_0.3/pg"]["sampler.noise_sigma"] == 0.3
  fp4kv = by["bf16_fp4kv/pg"]
  assert fp4kv["model.dtype"] == "bfloat16" and fp4kv["sampler.quant"]["kv"]["format"] == "fp4"
  assert by["clean/pg"]["loss.score_centering"] == "none"
  assert by["clean/sc"]["loss.score_centering"] == "topk" and by["clean/sc"]["loss.topk"] == 16


def _dose_score(panel, line, seed, evals, start=0.3, first=0.3, kl=0.01):
  return RunScore(panel=panel, line=line, seed=seed, primary=None, start=start, peak=max(v for _, v in evals),
                  outcome=None, aborted_step=None, first_train_accuracy=first, mean_kl=kl,
                  mean_routing_agreement=None, evals=tuple(evals), commit="c", protocol="d")


def test_rule_dose_response_picks_the_mildest_regime_where_pg_learns_then_fails():
  steps = (0, 20, 40, 60, 80, 100)
  rising = [(k, 0.3 + k / 1000) for k in steps]                       # clean: +0.09 over the window
  flat = [(k, 0.31) for k in steps]
  rise_then_zero = [(0, 0.3), (20, 0.36), (40, 0.2), (60, 0.0), (80, 0.1), (100, 0.2)]
  scores = []
  for seed in range(3):
    scores += [_dose_score("clean", "pg", seed, rising + [(200, 0.5)]), _dose_score("clean", "sc", seed, rising)]
    # noise_0.2 fails on 1 of 3 seeds (qualifies), KL 0.2; async_4 on 2 of 3, KL 0.05; stale_16 never.
    scores += [_dose_score("noise_0.2", "pg", seed, rise_then_zero if seed == 0 else flat, kl=0.2),
               _dose_score("async_4", "pg", seed, rise_then_zero if seed < 2 else flat, kl=0.05),
               _dose_score("stale_16", "pg", seed, flat, kl=0.01),
               # broken at step 0: fails on every seed but earns < 0.8 of the clean first-step accuracy
               _dose_score("noise_0.3", "pg", seed, rise_then_zero, first=0.1, kl=0.001)]
    for p in ("noise_0.2", "async_4", "stale_16", "noise_0.3"):
      scores.append(_dose_score(p, "sc", seed, rising))
  table, text, d = rules.dose_response(scores)
  assert d["window"] == [60, 80, 100] and d["clean_gain_clear"]
  assert d["qualifying"] == ["async_4", "noise_0.2"] and d["regime"] == "async_4"
  assert d["per_source"] == {"async": "async_4", "noise": "noise_0.2"}
  assert "broken at step 0" in table and "**async_4**" in text
  assert d["paired_sd_sc_pg"] > 0
  assert d["plateau"]["clean/pg"] == {"step": 200, "still_rising": True}
  # A flat curve plateaus at its first trailing mean (3 evaluations in); one that keeps rising does
  # so within its last 3 evaluations.
  assert rules.plateau_step([_dose_score("x", "pg", 0, [(k, 0.31) for k in range(0, 201, 20)])]) == (60, False)
  assert rules.plateau_step([_dose_score("x", "pg", 0, [(k, 0.31) for k in range(0, 101, 20)])]) == (60, True)
  # Without a clear clean gain nothing qualifies.
  dull = [s if s.panel != "clean" else dataclasses_replace(s, evals=tuple(flat)) for s in scores]
  assert rules.dose_response(dull)[2]["regime"] is None


def dataclasses_replace(s, **kw):
  import dataclasses
  return dataclasses.replace(s, **kw)


def test_dose_figure_reads_each_dose_over_the_rule_window(tmp_path):
  """dose_figure's cells: window means, collapse flags and the t interval by hand; publish copies the png."""
  steps = (0, 20, 40, 60, 80, 100)
  rows = []
  for seed, top in enumerate((0.30, 0.33, 0.36)):
    rows.append(_dose_score("clean", "pg", seed, [(k, top) for k in steps]).as_dict())
    # async_4 pg: seed 0 falls to 0 (collapsed, at the floor); the others stay at 0.2.
    falls = [(0, 0.3), (20, 0.3), (40, 0.1), (60, 0.0), (80, 0.0), (100, 0.0)]
    rows.append(_dose_score("async_4", "pg", seed, falls if seed == 0 else [(k, 0.2) for k in steps]).as_dict())
  cs = {(c.source, c.dose, c.line): c for c in dose_figure.cells(rows)}
  clean, lag = cs[("clean", "0", "pg")], cs[("async", "4", "pg")]
  assert clean.window_means == pytest.approx((0.30, 0.33, 0.36)) and not any(clean.collapsed)
  assert lag.window_means == pytest.approx((0.0, 0.2, 0.2))
  assert lag.collapsed == (True, False, False)   # the one definition: eval <= 0.005 after step 20
  # Two evaluations below half the running best (the exploratory studies' old criterion) are no collapse.
  dips = [_dose_score("async_4", "pg", 0, [(0, 0.3), (20, 0.4), (40, 0.1), (60, 0.1), (80, 0.3), (100, 0.3)]).as_dict(),
          _dose_score("clean", "pg", 0, [(k, 0.3) for k in steps]).as_dict()]
  assert not any(any(c.collapsed) for c in dose_figure.cells(dips))
  m, h = dose_figure.mean_ci(clean.window_means)
  assert m == pytest.approx(0.33) and h == pytest.approx(4.302652729911275 * 0.03 / 3 ** 0.5)
  md = dose_figure.markdown(list(cs.values()))
  assert "| async | 4 | 0.133 [" in md and "| 1/3 |" in md
  with open(tmp_path / "per_seed.json", "w") as f:
    json.dump(rows, f)
  for name in ("verdict.md", "table.md"):
    (tmp_path / name).write_text("x\n")
  paths = dose_figure.write(str(tmp_path))
  import shutil
  shutil.copyfile(paths["png"], tmp_path / "figure.png")
  out = publish.publish(str(tmp_path), "dose", str(tmp_path / "pub"))
  assert os.path.exists(out["dose_response.png"]) and os.path.exists(out["dose_response.md"])


def test_lr_sharp_study_is_declared_before_its_runs():
  s = studies.get("lr_sharp")
  assert s.protocol is not None and s.protocol.rule == "best_lr" and s.base == studies.DOSE_BASE
  by = {r.name: r.overrides for r in s.runs()}
  assert sorted(by) == ["lr_0.03/pg", "lr_0.1/pg", "lr_0.3/pg"] and s.seeds == 3 and s.steps == 400
  assert {o["optim.lr"] for o in by.values()} == {0.03, 0.1, 0.3}
  assert all(o["sampler.quant"] == "none" and o["loss.score_centering"] == "none" for o in by.values())


def test_dose_response_at_lr_sharps_rate_is_the_same_ladder():
  a, b = studies.get("dose_response"), studies.get("dose_response_lr003")
  assert b.protocol == a.protocol and b.base == a.base and b.seeds == a.seeds and b.lines == a.lines
  ra, rb = {r.name: r.overrides for r in a.runs()}, {r.name: r.overrides for r in b.runs()}
  assert set(ra) == set(rb)
  for name in ra:
    assert rb[name]["optim.lr"] == 0.03 and dict(rb[name], **{"optim.lr": ra[name]["optim.lr"]}) == ra[name]


def test_exact_mcnemar_by_hand():
  # 7 discordant pairs, 1 one way: P(X <= 1 | Bin(7, 1/2)) = (1 + 7) / 128, two-sided 16 / 128.
  assert stats.mcnemar_exact_p(1, 6) == pytest.approx(16 / 128, abs=1e-15)
  assert stats.mcnemar_exact_p(6, 1) == stats.mcnemar_exact_p(1, 6)
  assert stats.mcnemar_exact_p(0, 6) == pytest.approx(2 / 64, abs=1e-15)   # the fewest discordant pairs for < 0.05
  assert stats.mcnemar_exact_p(0, 5) == pytest.approx(2 / 32, abs=1e-15)
  assert stats.mcnemar_exact_p(3, 3) == 1.0 and stats.mcnemar_exact_p(0, 0) == 1.0
  # Concordant pairs do not enter; unpaired seeds are ignored.
  ev = stats.paired_events({0: True, 1: True, 2: False, 3: False, 9: True}, {0: True, 1: False, 2: False, 3: True})
  assert (ev.n, ev.a_events, ev.b_events, ev.a_only, ev.b_only, ev.p) == (4, 2, 2, 1, 1, 1.0)


def test_second_half_window_and_the_collapse_event():
  proto = Protocol(rule="best_lr", window="second_half", collapse_floor=0.005, collapse_after=20)
  assert proto.window_steps(100, 20) == [60, 80, 100] and proto.window_steps(400, 20)[0] == 220
  assert len(proto.window_steps(400, 20)) == 10
  s = protocol.score_run(_run([(0, 0.1), (20, 0.0), (40, 0.3), (60, 0.2), (80, 0.004), (100, 0.3)]), proto, 100, 20,
                         1024)
  # The window is steps 60 / 80 / 100; the evaluation at step 20 is not after step 20, so the event is at 80.
  assert s.primary == pytest.approx((0.2 + 0.004 + 0.3) / 3) and s.collapse_step == 80
  fine = protocol.score_run(_run([(0, 0.1), (20, 0.2), (40, 0.3), (60, 0.2), (80, 0.1), (100, 0.3)]), proto, 100, 20,
                            1024)
  assert fine.collapse_step is None
  ab = _run([(0, 0.1), (20, 0.3), (40, 0.3)], failed={"error": "FloatingPointError: non-finite loss"})
  ab.rows.append({"step": 44, "reward": 0.0})
  assert protocol.score_run(ab, proto, 100, 20, 1024).collapse_step == 45
  # Without a declared floor the event is still reported, at the one definition's floor (0.005 after
  # step 20; no contrast tests it); the default window is the last k.
  assert protocol.score_run(_run([(0, 0.1), (20, 0.0)]), Protocol(rule="best_lr"), 20, 20, 1024).collapse_step is None
  assert protocol.score_run(_run([(0, 0.1), (20, 0.2), (40, 0.0)]), Protocol(rule="best_lr"), 40, 20,
                            1024).collapse_step == 40
  assert protocol.score_run(_run([(0, 0.1), (20, 0.2), (40, 0.006)]), Protocol(rule="best_lr"), 40, 20,
                            1024).collapse_step is None
  with pytest.raises(ValueError, match="window"):
    Protocol(rule="best_lr", window="last_half")


@pytest.mark.parametrize("name", sorted(n for n in os.listdir("docs/results")
                                        if os.path.exists(f"docs/results/{n}/protocol.json")))
def test_published_digests_are_what_the_code_declares(name):
  # A field added to Protocol must not change an earlier study's digest, which its runs recorded.
  want = json.load(open(f"docs/results/{name}/protocol.json"))["digest"]
  s = studies.get(name)
  assert s.protocol.digest(protocol.study_definition(s)) == want


def test_contrasts_study_is_declared_before_its_runs():
  s = studies.get("contrasts")
  p = s.protocol
  assert (p.window, p.collapse_floor, p.collapse_after, s.seeds, s.steps) == ("second_half", 0.005, 20, 20, 400)
  # The digest its runs recorded (docs/results/contrasts/runs_part*.tgz, study.json): the declaration is unchanged.
  assert p.digest(protocol.study_definition(s)) == "7831ef93792b5d74"
  by = {r.name: r.overrides for r in s.runs()}
  assert len(by) == 9 and s.base == studies.DOSE_BASE
  cal = {r.name: r.overrides for r in studies.get("dose_response_lr003").runs()}
  # The same cell as the calibration that chose it: PG there is the calibration's run exactly.
  assert by["bf16_fp4kv/pg"] == cal["bf16_fp4kv/pg"]
  assert by["bf16_fp8/minirl"]["sampler.quant"] == cal["bf16_fp8/pg"]["sampler.quant"] == "fp8_wa_fp8_kv"
  for c in p.contrasts:
    assert f"{c.panel}/{c.a}" in by and f"{c.panel}/{c.b}" in by


def test_collapse_endpoint_in_the_analysis():
  proto = Protocol(contrasts=(Contrast("n", "a", "b"),), collapse_floor=0.005)
  study = dataclasses_replace(STUDY, lines=(("a", {}), ("b", {})), protocol=proto)
  digest = proto.digest(protocol.study_definition(study))
  mk = lambda line, seed, ev: dataclasses_replace(_score("n", seed, 0.3 + 0.01 * seed * (line == "a"), line=line),
                                                  collapse_step=ev, protocol=digest)
  scores = [mk("a", k, None) for k in range(8)] + [mk("b", k, 40 if k < 7 else None) for k in range(8)]
  an = verdicts.analyze(study, scores, [])
  r = an.contrasts[0]
  assert (r.collapse.n, r.collapse.a_only, r.collapse.b_only) == (8, 0, 7) and r.collapse.p == pytest.approx(2 / 128)
  assert r.collapse_p_holm == pytest.approx(2 / 128) and "a collapses less often" in r.collapse_verdict
  assert "Collapse endpoint" in verdicts.markdown(an) and "second half" not in verdicts.markdown(an)


def test_rule_pg_fails_reads_only_clean_and_pg_and_takes_the_largest_deficit():
  """Issue 53's rule by hand: clean primaries 0.40 / 0.42 / 0.44 (gains +0.10 / +0.12 / +0.14, s.d.
  0.02, so clause (b) needs a PG deficit > 0.04)."""
  sc = lambda panel, line, seed, primary, start=0.30: dataclasses_replace(
      _score(panel, seed, primary, start=start, line=line), collapse_step=None)
  scores = [sc("clean", "pg", k, 0.40 + 0.02 * k) for k in range(3)]
  # stale_16: PG 0.28 / 0.29 / 0.31 -> mean 0.2933, deficit 0.1267, below its start on 2 of 3: qualifies.
  scores += [sc("stale_16", "pg", k, v) for k, v in enumerate((0.28, 0.29, 0.31))]
  # async_8: PG 0.20 / 0.25 / 0.35 -> deficit 0.153 (larger), below on 2 of 3: qualifies, chosen.
  scores += [sc("async_8", "pg", k, v) for k, v in enumerate((0.20, 0.25, 0.35))]
  # stale_32: deficit 0.22 but below its start on 1 of 3 only (its warm start is lower): no.
  scores += [sc("stale_32", "pg", k, v, start=s) for k, (v, s) in enumerate(((0.2, 0.3), (0.2, 0.1), (0.2, 0.1)))]
  # async_6: below its (higher) start on 3 of 3, deficit 0.03 <= 0.04: no.
  scores += [sc("async_6", "pg", k, 0.39, start=0.45) for k in range(3)]
  others = [sc(p, line, k, 0.5 + 0.01 * k) for p in ("stale_16", "async_8", "stale_32", "async_6")
            for line in ("sc", "tis", "sc_tis") for k in range(3)]
  table, text, d = rules.pg_fails(scores + others)
  assert d["clean_gain_clear"] and d["clean_sd"] == pytest.approx(0.02)
  assert d["qualifying"] == ["async_8", "stale_16"] and d["regime"] == "async_8"
  assert d["cells"]["stale_16"]["deficit"] == pytest.approx(0.42 - (0.28 + 0.29 + 0.31) / 3)
  assert d["cells"]["stale_32"]["pg_below_start"] == 1 and d["cells"]["async_6"]["pg_below_start"] == 3
  assert d["paired"]["sc-pg"]["mean"] == pytest.approx((0.30 + 0.26 + 0.17) / 3)
  assert "**async_8**" in text and "| async_6 |" in table
  # The other arms decide nothing: any values there leave the choice as it was.
  flipped = [dataclasses_replace(s, primary=0.0) for s in others]
  assert rules.pg_fails(scores + flipped)[2]["qualifying"] == d["qualifying"]
  # Without a clear clean gain (one seed loses) nothing qualifies.
  dull = [dataclasses_replace(s, primary=0.29) if s.panel == "clean" and s.seed == 0 else s for s in scores]
  assert rules.pg_fails(dull)[2]["regime"] is None


def test_calibrate3_is_declared_before_its_runs():
  s = studies.get("calibrate3")
  p = s.protocol
  assert (p.rule, p.window, p.collapse_floor, s.seeds, s.steps) == ("pg_fails", "second_half", 0.005, 6, 600)
  by = {r.name: r.overrides for r in s.runs()}
  assert sorted(by) == sorted(["clean/pg"] + [f"{c}/{a}" for c in ("stale_16", "stale_32", "async_6", "async_8")
                                              for a in ("pg", "sc", "tis", "sc_tis")])
  cal = {r.name: r.overrides for r in studies.get("dose_response_lr003").runs()}
  # The same cells as the round-2 ladder, only longer: its PG there differs by rl.steps alone.
  for cell in ("stale_16", "async_8"):
    assert dict(by[f"{cell}/pg"], **{"rl.steps": 400}) == cal[f"{cell}/pg"] and by[f"{cell}/pg"]["rl.steps"] == 600
  assert by["clean/pg"]["optim.lr"] == 0.03
  assert by["async_8/sc_tis"]["loss.method"] == "tis" and by["async_8/sc_tis"]["loss.score_centering"] == "topk"


def test_corrections_study_holds_every_registered_method_in_one_regime():
  """Issue 56: the comparison runs every method the loss module registers, the centering and the
  switches, in one regime (the published ladder's staleness 16 at lr 0.03), exploratory."""
  from rl_jax.rl.loss.loss_config import registered_methods  # pylint: disable=g-import-not-at-top
  s = studies.get("corrections")
  by = {r.line: r.overrides for r in s.runs()}
  assert set(registered_methods()) <= set(by) and s.protocol is None and s.seeds == 6 and s.steps == 600
  assert {r.panel for r in s.runs()} == {"stale_16"}
  cal = {r.name: r.overrides for r in studies.get("dose_response_lr003").runs()}
  assert dict(by["pg"], **{"rl.steps": 400}) == cal["stale_16/pg"]
  assert by["pg_reject_k3"]["loss.rejection"] == "k3" and by["tis_p_old"]["loss.is_ratio"] == "p_old"


def test_runs_of_other_environments_are_not_pooled():
  """Issue 53: runs of one commit on machines that compute differently are not bit-identical, so the
  analysis refuses to pool runs whose run.json records different environments (none recorded: no check)."""
  env = {"cpu": "AMD EPYC", "packages": {"jax": "0.10.2"}, "xla_flags": ""}
  key = protocol.environment_key({"environment": env, "history": []})
  other = protocol.environment_key({"environment": dict(env, cpu="Intel Xeon")})
  assert key and key != other and protocol.environment_key(None) == "" == protocol.environment_key({"config": {}})
  resumed = protocol.environment_key({"environment": env, "history": [{"changed": []}, {"environment": env},
                                                                      {"environment": dict(env, cpu="Intel Xeon")}]})
  assert resumed == f"{key}|{other}"
  proto = Protocol(contrasts=(Contrast("n", "a", "b"),))
  study = dataclasses_replace(STUDY, lines=(("a", {}), ("b", {})), protocol=proto)
  digest = proto.digest(protocol.study_definition(study))
  mk = lambda line, seed, e: dataclasses_replace(_score("n", seed, 0.3 + 0.01 * seed, line=line), protocol=digest,
                                                 environment=e)
  same = [mk(line, k, key) for line in ("a", "b") for k in range(3)]
  assert verdicts.analyze(study, same, []).mixed == []
  assert verdicts.analyze(study, same + [mk("a", 3, ""), mk("b", 3, "")], []).mixed == []   # older runs
  with pytest.raises(verdicts.MixedRunsError, match="2 environments"):
    verdicts.analyze(study, same[:-1] + [mk("b", 2, other)], [])
