"""rl_jax.analysis: loading, mean / s.e. over seeds by hand, collapse detector, figures, tables, CLI."""
import json
import math
import os

import numpy as np
import pytest

from rl_jax import analysis
from rl_jax.analysis import __main__ as cli
from rl_jax.analysis import aggregate, runs as runs_lib


def write_run(workdir, rows, config=None, summary=None, failed=None):
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
    for r in rows:
      f.write(json.dumps(r) + "\n")
  for name, obj in (("config.json", config), ("summary.json", summary), ("failed.json", failed)):
    if obj is not None:
      with open(os.path.join(workdir, name), "w") as f:
        json.dump(obj, f)


def rows_of(acc, kl, kl_key="mismatch/kl_k1"):
  """Eval at step 0 and every step; reward = acc; one train row per step >= 1."""
  out = [{"step": 0, "eval_greedy_accuracy": acc[0]}]
  for s in range(1, len(acc)):
    out.append({"step": s, "reward": acc[s], kl_key: kl[s], "loss/entropy": 1.0,
                "eval_greedy_accuracy": acc[s]})
  return out


def test_mean_se_by_hand():
  m, se, n = aggregate.mean_se([1.0, 2.0, 4.0])
  # mean 7/3; sample variance ((4/3)^2 + (1/3)^2 + (5/3)^2) / 2 = 7/3; s.e. sqrt(7/3 / 3)
  assert n == 3 and m == pytest.approx(7 / 3, abs=1e-12)
  assert se == pytest.approx(math.sqrt(7 / 9), abs=1e-12)
  assert math.isnan(aggregate.mean_se([5.0])[1]) and aggregate.mean_se([5.0])[0] == 5.0
  assert aggregate.mean_se([1.0, float("nan"), 3.0])[:2] == (2.0, pytest.approx(1.0))
  assert aggregate.mean_se([])[2] == 0


def test_moving_average_centered_shrinking():
  np.testing.assert_allclose(aggregate.moving_average([0, 3, 6, 9], 3), [1.5, 3, 6, 7.5])
  np.testing.assert_allclose(aggregate.moving_average([1, float("nan"), 3], 3), [1, 2, 3])


def test_collapse_detector():
  """The one definition (issue 53): the protocol's collapse endpoint, an evaluation after step 20 at or
  below 0.005 (or non-finite), or an abort when no evaluation before it got there."""
  steps = [0, 20, 40, 60, 80, 100]
  assert (aggregate.COLLAPSE_FLOOR, aggregate.COLLAPSE_AFTER) == (0.005, 20)
  assert aggregate.collapse_step(steps, [0.3, 0.4, 0.1, 0.3, 0.1, 0.1]) is None    # dips, never the floor
  assert aggregate.collapse_step(steps, [0.3, 0.0, 0.3, 0.3, 0.3, 0.3]) is None    # at step 20: not after it
  assert aggregate.collapse_step(steps, [0.3, 0.4, 0.1, 0.005, 0.3, 0.3]) == 60    # at the floor; recovery counts not
  assert aggregate.collapse_step(steps, [0.3, 0.4, 0.1, 0.0051, 0.3, 0.3]) is None
  assert aggregate.collapse_step(steps, [0.3, 0.4, float("nan"), 0.3, 0.0, 0.0]) == 40   # non-finite
  assert aggregate.collapse_step(steps, [0.0] * 6) == 40                           # a floor run is one
  assert aggregate.collapse_step(steps, [0.3] * 6, aborted_step=55) == 55          # an abort
  assert aggregate.collapse_step(steps, [0.3, 0.3, 0.0, 0.3, 0.3, 0.3], aborted_step=55) == 40   # floor first
  assert aggregate.collapse_step(steps, [0.3, 0.3, 0.1, 0.01, 0.3, 0.3], floor=0.01, after=0) == 60
  with pytest.raises(ValueError):
    aggregate.collapse_step(steps, [0.3] * 6, floor=1.0)


def test_load_dedup_aliases_and_aggregate(tmp_path):
  a, b = [0.1, 0.2, 0.3], [0.1, 0.4, 0.5]
  write_run(tmp_path / "pg" / "seed0", rows_of(a, [0, 1e-3, 2e-3], kl_key="kl_k1"))   # old name
  rows = rows_of(b, [0, 3e-3, 4e-3])
  # A resumed run re-logs step 2 after its checkpoint at step 1: the last write wins.
  rows.insert(2, {"step": 2, "reward": -9.0, "eval_greedy_accuracy": -9.0})
  write_run(tmp_path / "pg" / "seed1", rows)
  write_run(tmp_path / "sc" / "seed0", rows_of([0.1, 0.1, 0.1], [0, 0, 0]))
  write_run(tmp_path / "warm_start", [{"step": 1, "loss": 2.0, "eval_accuracy": 0.1}])   # SFT: not a run
  runs = analysis.load_runs([str(tmp_path / "**")])
  assert [(r.name, r.seed) for r in runs] == [("pg", 0), ("pg", 1), ("sc", 0)]
  groups = analysis.group_runs(runs)
  assert [(g.name, g.n) for g in groups] == [("pg", 2), ("sc", 1)]
  c = aggregate.aggregate_curve(groups[0].runs, "mismatch/kl_k1")
  np.testing.assert_array_equal(c.steps, [1, 2])
  np.testing.assert_allclose(c.mean, [2e-3, 3e-3])
  np.testing.assert_allclose(c.se, [np.std([1e-3, 3e-3], ddof=1) / np.sqrt(2)] * 2)
  s = aggregate.summarize_group(groups[0])
  assert s.final_accuracy[:2] == (pytest.approx(0.4), pytest.approx(np.std([0.3, 0.5], ddof=1) / np.sqrt(2)))
  assert s.best_accuracy[0] == pytest.approx(0.4)
  assert s.mean_kl[0] == pytest.approx(np.mean([np.mean([1e-3, 2e-3]), np.mean([3e-3, 4e-3])]))
  assert s.collapse_steps == [None, None]
  # Steps 0, 1, 2: the second half (steps > 1) is the last evaluation alone, 0.3 and 0.5.
  assert s.extra[aggregate.SECOND_HALF][0] == pytest.approx(0.4)
  assert "loss/seq_frac_dropped" not in s.extra   # reported only where a run logged it


def test_nonfinite_and_aborted_runs_collapse(tmp_path):
  rows = rows_of([0.1, 0.4, 0.4], [0, 1e-3, 1e-3])
  rows[2]["eval_greedy_accuracy"] = "nan"   # MetricsWriter's spelling of a non-finite value
  write_run(tmp_path / "nan" / "seed0", rows)
  write_run(tmp_path / "abort" / "seed0", rows_of([0.1, 0.4], [0, 1e-3]),
            failed={"rc": 1, "error": "FloatingPointError: non-finite loss or gradient at RL step 2"})
  groups = analysis.group_runs(analysis.load_runs(str(tmp_path / "*" / "seed*")))
  # These runs log every step, so the endpoint's "after step 20" is moved to 0 (an abort counts anywhere).
  got = {g.name: aggregate.summarize_group(g, after=0).collapse_steps for g in groups}
  assert got == {"nan": [2], "abort": [2]}
  assert {g.name: aggregate.summarize_group(g).collapse_steps for g in groups} == {"nan": [None], "abort": [2]}


def test_group_by_config_key_and_figures_tables(tmp_path):
  for i, (method, sigma) in enumerate([("pg", 0.1), ("pg", 0.1), ("tis", 0.1), ("pg", 0.2)]):
    cfg = {"seed": i, "loss": {"method": method}, "sampler": {"noise_sigma": sigma}}
    write_run(tmp_path / f"r{i}", rows_of([0.1, 0.2 + 0.01 * i, 0.3], [0, 1e-3, 1e-3]), config=cfg)
  runs = analysis.load_runs(str(tmp_path / "r*"))
  groups = analysis.group_runs(runs, group_by="loss.method", panel_by="sampler.noise_sigma")
  assert [(g.panel, g.line, g.n) for g in groups] == [
      ("sampler.noise_sigma=0.1", "pg", 2), ("sampler.noise_sigma=0.1", "tis", 1),
      ("sampler.noise_sigma=0.2", "pg", 1)]
  paths, summaries = analysis.compare(groups, str(tmp_path / "out"))
  for p in paths.values():
    assert os.path.getsize(p) > 0
  md = open(paths["md"]).read()
  assert "| sampler.noise_sigma=0.1/pg | 2 | 0.3 +- 0 |" in md
  table = json.load(open(paths["json"]))
  assert table[1]["final_accuracy"] == {"mean": 0.3, "se": None, "n": 1}
  assert open(paths["csv"]).readline().startswith("name,panel,line,n_seeds")
  with pytest.raises(ValueError, match="no stored config"):
    write_run(tmp_path / "bare" / "seed0", rows_of([0.1, 0.2], [0, 0]))
    analysis.group_runs(analysis.load_runs(str(tmp_path / "bare" / "seed*")), group_by="loss.method")


def test_grouping_never_pools_what_differs(tmp_path, capsys):
  """PG and SC share loss.method='pg' (SC is loss.score_centering): grouping by the method alone must
  not merge them silently; by default the groups are the keys that differ (the seed aside)."""
  for sc in ("none", "topk"):
    for seed in (0, 1, 2):
      cfg = {"seed": seed, "loss": {"method": "pg", "score_centering": sc},
             "logging": {"run_name": f"r{seed}"}, "warm_start": {"path": f"/ws{seed}"}}
      write_run(tmp_path / f"{sc}" / f"seed{seed}", rows_of([0.1, 0.2], [0, 1e-3]), config=cfg)
  runs = analysis.load_runs(str(tmp_path / "*" / "seed*"))
  groups = analysis.group_runs(runs)
  assert [(g.line, g.n, g.keys) for g in groups] == [
      ("loss.score_centering=none", 3, {"loss.score_centering": "none"}),
      ("loss.score_centering=topk", 3, {"loss.score_centering": "topk"})]
  with pytest.raises(runs_lib.MixedGroupError, match="pools runs differing in loss.score_centering"):
    analysis.group_runs(runs, group_by="loss.method")
  both = analysis.group_runs(runs, group_by="loss.method,loss.score_centering")
  assert [g.n for g in both] == [3, 3]
  merged = analysis.group_runs(runs, group_by="loss.method", allow_mixed=True)
  assert [(g.n, g.mixed) for g in merged] == [(6, ["loss.score_centering"])]
  out = tmp_path / "cmp"
  assert cli.main(["--workdirs", str(tmp_path / "*" / "seed*"), "--out", str(out), "--group_by",
                   "loss.method"]) == 2
  assert "loss.score_centering" in capsys.readouterr().err
  assert cli.main(["--workdirs", str(tmp_path / "*" / "seed*"), "--out", str(out)]) == 0
  assert "grouped by: loss.score_centering" in capsys.readouterr().out


def test_cli(tmp_path, capsys):
  for name in ("a", "b"):
    for seed in (0, 1):
      acc = [0.1] + [0.1 + 0.01 * s * (seed + 1) for s in range(1, 40)]
      write_run(tmp_path / "runs" / name / f"seed{seed}", rows_of(acc, [0] + [1e-3] * 39))
  out = tmp_path / "cmp"
  assert cli.main(["--workdirs", str(tmp_path / "runs" / "*" / "seed*"), "--out", str(out)]) == 0
  assert "4 runs in 2 groups" in capsys.readouterr().out
  assert sorted(os.listdir(out)) == ["figure.png", "table.csv", "table.json", "table.md"]
  with pytest.raises(SystemExit):
    cli.main(["--workdirs", str(tmp_path / "nothing*"), "--out", str(out)])


def test_config_value_sources(tmp_path):
  write_run(tmp_path / "w", rows_of([0.1, 0.2], [0, 0]), config={"loss": {"method": "tis"}})
  with open(tmp_path / "w" / "study.json", "w") as f:
    json.dump({"run": "p/l", "panel": "p", "line": "l", "seed": 3, "overrides": {"rl.steps": 2}}, f)
  r = runs_lib.load_run(str(tmp_path / "w"))
  assert (r.config_value("loss.method"), r.config_value("rl.steps"), r.config_value("x.y"), r.seed) == \
      ("tis", 2, None, 3)
  # The run-state file run.json holds the resolved config under "config"; it wins over config.json.
  with open(tmp_path / "w" / "run.json", "w") as f:
    json.dump({"identity": {"run_id": "x"}, "config": {"loss": {"method": "mis"}}, "history": []}, f)
  assert runs_lib.load_run(str(tmp_path / "w")).config_value("loss.method") == "mis"


def test_meters_are_aliased_drawn_and_tabled(tmp_path, monkeypatch):
  """drift/tv_mean (also under its earlier name loss/drift/tv_mean) and first_order/cosine
  (logged every M steps) get their own figure rows and table columns."""
  old = rows_of([0.1, 0.2, 0.3], [0, 1e-3, 1e-3])
  new = rows_of([0.1, 0.2, 0.3], [0, 1e-3, 1e-3])
  for s, (r_old, r_new) in enumerate(zip(old[1:], new[1:]), start=1):
    r_old["loss/drift/tv_mean"] = 0.01 * s
    r_new["drift/tv_mean"] = 0.03 * s
  new[2]["first_order/cosine"] = 0.8
  # A zero-gradient reading (no reward in the meter's batch: cosine and norm ratio both 0) is left out.
  new[1].update({"first_order/cosine": 0.0, "first_order/norm_ratio": 0.0})
  write_run(tmp_path / "m" / "seed0", old)
  write_run(tmp_path / "m" / "seed1", new)
  groups = analysis.group_runs(analysis.load_runs(str(tmp_path / "m" / "seed*")))
  c = aggregate.aggregate_curve(groups[0].runs, "drift/tv_mean")
  np.testing.assert_allclose(c.mean, [0.02, 0.04])
  labels = []
  real_close = analysis.figures.plt.close

  def spy_close(fig):
    labels.extend(ax.get_ylabel() for ax in fig.axes)
    real_close(fig)
  monkeypatch.setattr(analysis.figures.plt, "close", spy_close)
  _, summaries = analysis.compare(groups, str(tmp_path / "out"))
  assert "Drift TV (mean)" in labels and "First-order cosine" in labels
  extra = summaries[0].extra
  assert extra["drift/tv_mean"][0] == pytest.approx(np.mean([0.015, 0.045]))
  assert extra["first_order/cosine"][:3:2] == (pytest.approx(0.8), 1)
