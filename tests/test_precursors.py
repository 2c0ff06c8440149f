"""rl_jax.analysis.precursors: meter alarms against accuracy collapses, on hand-built runs."""
import pytest

from rl_jax.analysis import precursors as P
from rl_jax.analysis.runs import Group, Run


def _run(name, seed, acc_by_step, tv, cos):
  """Eval rows at the steps of `acc_by_step`; drift every step; cosine every 10 steps."""
  rows = {}
  for s, a in acc_by_step.items():
    rows.setdefault(s, {"step": s})["eval_greedy_accuracy"] = a
  for s, v in enumerate(tv):
    rows.setdefault(s, {"step": s})["drift/tv_mean"] = v
  for i, v in enumerate(cos):
    rows.setdefault(10 * i, {"step": 10 * i})["first_order/cosine"] = v
  return Run(workdir=f"/x/{name}/seed{seed}", name=name, seed=seed, rows=[rows[s] for s in sorted(rows)])


def test_alarm_step_up_down_and_edge_cases():
  steps = list(range(0, 60, 10))
  assert P.alarm_step(steps, [0.1, 0.1, 0.15, 0.25, 0.1, 0.1], "up", 2.0) == 30     # baseline median 0.1
  assert P.alarm_step(steps, [0.1, 0.1, 0.15, 0.19, 0.1, 0.1], "up", 2.0) is None
  # A spike inside the baseline window is not an alarm, and the median ignores it (0.1, not 0.37).
  assert P.alarm_step([0, 5, 10, 20, 30], [0.1, 0.9, 0.1, 0.2, 0.3], "up", 2.0) == 20
  assert P.alarm_step(steps, [0.9, 0.8, 0.5, 0.4, 0.3, 0.1], "down", 0.5) == 30       # 0.4 <= 0.85 / 2
  assert P.alarm_step(steps, [0.9, 0.8, 0.5, float("nan"), 0.5, 0.5], "down", 0.5) == 30
  assert P.alarm_step(steps, [0.0, 0.0, 1.0, 1.0, 1.0, 1.0], "up", 2.0) is None      # nothing to scale
  assert P.alarm_step([30, 40], [0.1, 0.5], "up", 2.0) == 40                          # first reading is the baseline
  with pytest.raises(ValueError, match="direction"):
    P.alarm_step(steps, [0.1] * 6, "sideways", 2.0)


def test_kinds_leads_and_table():
  healthy = {0: 0.1, 20: 0.2, 40: 0.3, 60: 0.3, 80: 0.3}
  collapsing = {0: 0.1, 20: 0.3, 40: 0.3, 60: 0.0, 80: 0.0}   # at the floor (<= 0.005 after step 20): collapse at 60
  warned = _run("a", 0, collapsing, tv=[0.05] * 30 + [0.2] * 51, cos=[0.9, 0.9, 0.9, 0.3, 0.2, 0.1, 0, 0, 0])
  late = _run("a", 1, collapsing, tv=[0.05] * 70 + [0.2] * 11, cos=[0.9] * 9)
  false_alarm = _run("b", 0, healthy, tv=[0.05] * 50 + [0.2] * 31, cos=[0.9] * 9)
  quiet = _run("b", 1, healthy, tv=[0.05] * 81, cos=[0.9] * 9)
  by_meter = {p.meter: p for p in P.run_precursors(warned)}
  assert by_meter[P.DRIFT].collapse == 60 and by_meter[P.DRIFT].alarm == 30
  assert by_meter[P.DRIFT].kind == "warning" and by_meter[P.DRIFT].lead == 30
  assert by_meter[P.COSINE].alarm == 30 and by_meter[P.COSINE].lead == 30
  late_p = {p.meter: p for p in P.run_precursors(late)}
  assert late_p[P.DRIFT].kind == "late" and late_p[P.COSINE].kind == "missed"
  assert {p.kind for p in P.run_precursors(false_alarm) if p.meter == P.DRIFT} == {"false_alarm"}
  assert {p.kind for p in P.run_precursors(quiet)} == {"quiet"}
  # A zero-gradient reading (cosine 0 with norm ratio 0: no reward in the meter's batch) is no alarm.
  no_reward = _run("c", 0, healthy, tv=[0.05] * 81, cos=[0.9, 0.9, 0.9, 0.0, 0.9, 0.9, 0.9, 0.9, 0.9])
  for row in no_reward.rows:
    if "first_order/cosine" in row:
      row["first_order/norm_ratio"] = 0.0 if row["first_order/cosine"] == 0.0 else 0.7
  assert {p.kind for p in P.run_precursors(no_reward) if p.meter == P.COSINE} == {"quiet"}
  for row in no_reward.rows:
    if row.get("first_order/cosine") == 0.0:
      row["first_order/norm_ratio"] = 0.4   # a real gradient whose direction is orthogonal: an alarm
  assert [p.alarm for p in P.run_precursors(no_reward) if p.meter == P.COSINE] == [30]
  # A meter first read after the baseline window (rl.meter_every = 40) takes its first reading as
  # the baseline: 0.9 at step 40, 0.3 at step 80 is an alarm at 80 (after the collapse at 60: late).
  sparse = _run("d", 0, collapsing, tv=[0.05] * 81, cos=[])
  for row in sparse.rows:
    if row["step"] in (40, 80):
      row["first_order/cosine"] = 0.9 if row["step"] == 40 else 0.3
  cos_p = [p for p in P.run_precursors(sparse) if p.meter == P.COSINE]
  assert [(p.alarm, p.kind) for p in cos_p] == [(80, "late")]
  assert P.alarm_step([40, 80], [float("nan"), float("nan")], "down", 0.5) is None
  table = P.markdown([Group("a", "p", "a", [warned, late]), Group("b", "p", "b", [false_alarm, quiet])])
  assert "| a | drift/tv_mean | 2/2 | 1 (30) | 1 | 0 | 0/0 |" in table
  assert "| a | first_order/cosine | 2/2 | 1 (30) | 0 | 1 | 0/0 |" in table
  assert "| b | drift/tv_mean | 0/2 | 0 | 0 | 0 | 1/2 |" in table


def _finished(run, steps=80):
  run.summary, run.config = {"steps": steps}, {"rl": {"steps": steps}}
  return run


def test_decline_step_and_peak_excursion():
  ends_below = {0: 0.1, 20: 0.2, 40: 0.15, 60: 0.05, 80: 0.04, 100: 0.03}   # trailing-3 means 0.133, 0.08, 0.04
  assert P.decline_step(_run("a", 0, ends_below, tv=[], cos=[])) == 80
  # Below the start at the last evaluation only, but the trailing mean is still above: no collapse.
  assert P.decline_step(_run("a", 0, {0: 0.1, 20: 0.2, 40: 0.2, 60: 0.05}, tv=[], cos=[])) is None
  assert P.decline_step(_run("a", 0, {20: 0.2, 40: 0.01}, tv=[], cos=[])) is None           # no warm-start eval
  steps = [0, 10, 20, 30, 40]
  assert P.peak_excursion(steps, [0.1, 0.1, 0.3, 0.5, 0.2], "up", None) == pytest.approx(5.0)
  assert P.peak_excursion(steps, [0.1, 0.1, 0.3, 0.5, 0.2], "up", 20) == pytest.approx(3.0)
  assert P.peak_excursion(steps, [0.1, 0.1, 0.05, 0.08, 0.2], "up", None) == pytest.approx(2.0)
  assert P.peak_excursion(steps, [0.8, 0.8, 0.4, 0.6, 0.8], "down", None) == pytest.approx(2.0)
  assert P.peak_excursion(steps, [0.8, 0.8, 0.9, -0.1, 0.8], "down", None) == float("inf")   # cosine below 0
  assert P.peak_excursion(steps, [0.1, 0.1, 0.1, float("nan"), 0.1], "up", None) == float("inf")
  assert P.peak_excursion(steps, [0.0, 0.0, 1.0, 1.0, 1.0], "up", None) is None


def test_predictor_roc_agrees_with_the_alarms():
  collapsing = {0: 0.1, 20: 0.3, 40: 0.05, 60: 0.05, 80: 0.02}    # trailing means 0.133, 0.133, 0.04: step 80
  healthy = {0: 0.1, 20: 0.2, 40: 0.3, 60: 0.3, 80: 0.3}
  runs = [_finished(_run("c", i, collapsing, tv=[0.05] * 30 + [0.05 * (2 + i)] * 51, cos=[0.9] * 9))
          for i in range(3)]
  runs += [_finished(_run("h", i, healthy, tv=[0.05] * 50 + [0.05 * (1.2 + 0.5 * i)] * 31, cos=[0.9] * 9))
           for i in range(3)]
  unfinished = _run("u", 0, collapsing, tv=[0.05] * 81, cos=[0.9] * 9)       # no summary: left out
  rows = {r.meter: r for r in P.evaluate_predictors(runs + [unfinished], factors={"up": (1.5, 2.0, 3.0),
                                                                                  "down": (0.5,)})}
  tv = rows[P.DRIFT]
  assert (tv.n_collapsed, tv.n_other) == (3, 3)
  assert tv.auc == pytest.approx(8 / 9)       # excursions 2, 3, 4 against 1.2, 1.7, 2.2: only 2 < 2.2
  # TPR / FPR per factor, and each TPR equals the share of collapsed runs alarm_step warned in time.
  assert [(f, tpr, fpr) for f, tpr, fpr, _ in tv.by_factor] == [
      (1.5, 1.0, pytest.approx(2 / 3)), (2.0, 1.0, pytest.approx(1 / 3)), (3.0, pytest.approx(2 / 3), 0.0)]
  for f, tpr, _, lead in tv.by_factor:
    warned = [P.alarm_step(*r.series(P.DRIFT), "up", f) for r in runs[:3]]
    assert tpr == pytest.approx(sum(a is not None and a <= 80 for a in warned) / 3)
    assert lead == 50                           # every alarm at step 30, the collapse at 80
  assert rows[P.COSINE].auc == 0.5 and rows[P.COSINE].by_factor[0][1:3] == (0.0, 0.0)   # flat: no information
  assert "loss/is_ess" not in rows              # not logged by these runs
  table = P.predictors_markdown(list(rows.values()))
  assert "| `drift/tv_mean` | 3 / 3 | 0.89 | >= 1.5x baseline | 1.00 | 0.67 | 50 |" in table


def test_matched_window_auc_compares_each_pair_over_the_collapsed_runs_steps():
  """Issue 37's matched windows: a healthy run's late drift (after the collapse step) does not count."""
  steps = range(0, 81, 20)
  # Collapsed: accuracy at the floor from step 40; drift 3x from step 30 (before its event).
  crash = _finished(_run("c", 0, dict(zip(steps, [0.3, 0.3, 0.0, 0.0, 0.0])), tv=[0.1] * 30 + [0.3] * 51, cos=[0.9] * 9))
  # Healthy: drift 5x but only from step 60, after the collapsed run's event (40): matched, it is 1x.
  late = _finished(_run("h", 0, dict(zip(steps, [0.3] * 5)), tv=[0.1] * 60 + [0.5] * 21, cos=[0.9] * 9))
  # Healthy, drifting 4x from step 25: larger than the collapsed run's 3x inside the matched window.
  early = _finished(_run("h", 1, dict(zip(steps, [0.3] * 5)), tv=[0.1] * 25 + [0.4] * 56, cos=[0.9] * 9))
  assert P.floor_event_step(crash) == 40 and P.floor_event_step(late) is None
  # An evaluation at the floor at or before FLOOR_AFTER is not the event.
  assert P.floor_event_step(_run("e", 0, {0: 0.3, 20: 0.0, 40: 0.3}, tv=[0.1], cos=[0.9])) is None
  pairs = P.matched_pairs([crash, late, early], P.DRIFT, "up")
  assert sorted(pairs) == [(0, 1, 1.0), (0, 2, 0.0)]
  auc, lo, hi, nc, nn = P.matched_auc(pairs, resamples=200)
  assert auc == 0.5 and (nc, nn) == (1, 2) and lo == 0.0 and hi == 1.0
  # The unmatched ROC (whole window for healthy runs) counts the late run's 5x against the meter.
  unmatched = {r.meter: r for r in P.evaluate_predictors([crash, late, early], meters={P.DRIFT: "up"})}
  assert unmatched[P.DRIFT].auc == 0.0
  within = P.matched_pairs([crash, late, early], P.DRIFT, "up", within_panel=True, panel_of=lambda r: r.name)
  assert within == []        # no healthy run shares the collapsed run's panel
  assert "| `drift/tv_mean` | 1 / 2 | 0.50 [0.00, 1.00] | 0 |" in P.matched_markdown(
      [crash, late, early], panel_of=lambda r: r.name, meters={P.DRIFT: "up"})


@pytest.mark.parametrize("accs, aborted, want", [
    ({0: 0.3, 20: 0.0, 40: 0.2, 60: 0.004, 80: 0.2}, False, 60),  # step 20 is not "after 20"
    ({0: 0.3, 20: 0.2, 40: 0.003, 60: 0.1}, True, 40),             # the floor before the abort (at 61)
    ({0: 0.3, 20: 0.2, 40: 0.1, 60: 0.1}, True, 61),               # no floor: the abort step
    ({0: 0.3, 20: 0.2, 40: 0.1}, False, None),
])
def test_floor_event_step_is_the_protocols_collapse_event(accs, aborted, want):
  """The predictors' event and the study protocol's collapse endpoint are one definition."""
  from rl_jax import artifacts  # pylint: disable=g-import-not-at-top
  from rl_jax.study import protocol  # pylint: disable=g-import-not-at-top
  run = _run("pg", 0, accs, [], [])
  run.failed = {"reason": artifacts.NON_FINITE} if aborted else None
  evals = dict(zip(*run.series("eval_greedy_accuracy")))
  assert P.floor_event_step(run) == want
  assert protocol.floor_event(evals, run.aborted_step, P.FLOOR, P.FLOOR_AFTER) == want
