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
  collapsing = {0: 0.1, 20: 0.3, 40: 0.3, 60: 0.1, 80: 0.05}   # two evals below 0.15: collapse at 60
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
