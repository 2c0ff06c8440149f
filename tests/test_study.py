"""rl_jax.study: study grids, launch commands, the runner's skip / resume / aggregate logic (fake executor)."""
import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from PIL import Image

from rl_jax import artifacts
from rl_jax import preempt
from rl_jax.rl import job as job_lib
from rl_jax.study import __main__ as cli
from rl_jax.study import config as study_config
from rl_jax.study import archive, publish, runner, studies

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class FakeExecutor:
  """Writes what a finished (or crashed) trainer run leaves in its workdir: metrics.jsonl, summary.json."""

  def __init__(self, crash=()):
    self.calls = []
    self.crash = dict(crash)   # (name, seed) -> error text for its first call

  def __call__(self, launch, log_path):
    self.calls.append((launch.name, launch.seed))
    if launch.kind == "warm_start":
      return 0
    path = os.path.join(launch.workdir, "metrics.jsonl")
    start = 0
    if os.path.exists(path):   # resume: the trainer continues after its last logged step
      with open(path) as f:
        start = max(json.loads(line)["step"] for line in f if line.strip())
    key = (launch.name, launch.seed)
    acc = 0.1 + 0.1 * launch.seed + (0.05 if launch.run.line == "tis" else 0.0)
    with open(path, "a") as f:
      if start == 0:
        f.write(json.dumps({"step": 0, "eval_greedy_accuracy": 0.1}) + "\n")
      for s in range(start + 1, launch.steps + 1):
        f.write(json.dumps({"step": s, "reward": acc, "kl_k1": 1e-3 * (s + launch.seed),
                            "loss/entropy": 1.0, "eval_greedy_accuracy": acc}) + "\n")
        if key in self.crash:
          err = self.crash.pop(key)
          with open(log_path, "a") as log:
            log.write(err + "\n")
          # As rl_jax.main exits: a non-finite step is a run error, anything else a crash.
          return artifacts.RUN_ERROR if "non-finite" in err else 1
    with open(os.path.join(launch.workdir, "summary.json"), "w") as f:
      json.dump({"steps": launch.steps, "final_eval_greedy_accuracy": acc}, f)
    return 0


def test_studies_resolve_and_validate(monkeypatch):
  """Every run of every study builds a config the trainer accepts (names unknown keys, bad combinations)."""
  # The abstract quantization check costs ~0.5 s; it depends only on the model and the quant section.
  fits, seen = job_lib.check_sampler_fits, {}

  def check_once(model_cfg, s):
    key = repr((model_cfg, s.quant))
    if key not in seen:
      seen[key] = fits(model_cfg, s)

  monkeypatch.setattr(job_lib, "check_sampler_fits", check_once)
  names = set()
  for study in studies.STUDIES.values():
    runs = study.runs()
    assert len({r.name for r in runs}) == len(runs), study.name
    for r in runs:
      job_lib.RLJob.from_config(study_config.get_config(f"{study.name}/{r.name}"))
    names.add(study.name)
  assert {"micro", "fig3_weight_noise", "fig4_quant_stale", "fig2_online_offline", "fig5_topk_sc",
          "minirl_on_policy", "minirl_off_policy"} <= names
  ws = study_config.get_config("warm_start/fig3_weight_noise")
  assert ws.job == "sft" and ws.sft.steps == 100   # countdown_tiny's early SFT checkpoint
  with pytest.raises(KeyError, match="has no run"):
    study_config.get_config("micro/nope/pg")


def test_plan_commands(tmp_path):
  p = runner.plan(studies.get("micro"), str(tmp_path), steps=3)
  assert [(x.name, x.seed, x.steps) for x in p.launches] == [
      ("fp32/pg", 0, 3), ("fp32/pg", 1, 3), ("fp32/tis", 0, 3), ("fp32/tis", 1, 3)]
  cmd = p.launches[3].command
  for part in ("--config=configs/countdown_tiny.py:test", f"--workdir={tmp_path}/fp32/tis/seed1",
               "--config.loss.method=tis", "--config.rl.steps=3", "--config.seed=1",
               "--config.warm_start.source=sft", f"--config.warm_start.path={tmp_path}/warm_start"):
    assert part in cmd
  # A quantization section cannot be a flag: the run goes through the study's config file.
  q = runner.plan(studies.get("fig4_quant_stale"), str(tmp_path), seeds=1).launches[0]
  assert "--config=rl_jax/study/config.py:fig4_quant_stale/fp8_wa_fp4_kv/pg" in q.command


def test_runner_skips_resumes_and_aggregates(tmp_path):
  p = runner.plan(studies.get("micro"), str(tmp_path))
  fake = FakeExecutor(crash={("fp32/tis", 1): "killed"})
  counts = runner.run_study(p, executor=fake, progress=False)
  assert counts == {"skipped": 0, "ok": 3, "failed": 1, "preempted": 0}
  # The warm start, then seed-major: every cell's seed 0 before any seed 1.
  assert fake.calls == [("warm_start", 0), ("fp32/pg", 0), ("fp32/tis", 0), ("fp32/pg", 1), ("fp32/tis", 1)]
  assert runner.status(p.launches[3]) == "resume@1"
  assert json.load(open(tmp_path / "fp32/tis/seed1/failed.json"))["rc"] == 1
  # Aggregating now leaves the stopped run out of every number and names it.
  runner.aggregate_study(p)
  assert {r["name"]: r["seeds"] for r in json.load(open(tmp_path / "table.json"))}["fp32/tis"] == [0]
  assert "**Unfinished: 1 of 4 runs**" in open(tmp_path / "verdict.md").read()
  assert "fp32/tis/seed1" in open(tmp_path / "verdict.md").read()
  # Rerun: the warm start and finished runs are skipped, the crashed one resumes and finishes.
  fake.calls.clear()
  assert runner.run_study(p, executor=fake, progress=False) == {"skipped": 3, "ok": 1, "failed": 0, "preempted": 0}
  assert fake.calls == [("fp32/tis", 1)]
  assert not (tmp_path / "fp32/tis/seed1/failed.json").exists()
  fake.calls.clear()
  assert runner.run_study(p, executor=fake, progress=False) == {"skipped": 4, "ok": 0, "failed": 0, "preempted": 0}
  assert fake.calls == []
  # A longer study (--steps 3) resumes the runs that finished at 2 steps.
  longer = runner.plan(studies.get("micro"), str(tmp_path), steps=3)
  assert [runner.status(launch) for launch in longer.launches] == ["resume@2"] * 4
  paths = runner.aggregate_study(p, "python -m rl_jax.study micro")
  for k in ("png", "md", "csv", "json", "verdict"):
    assert os.path.getsize(paths[k]) > 0
  table = {row["name"]: row for row in json.load(open(paths["json"]))}
  assert table["fp32/pg"]["final_accuracy"]["mean"] == pytest.approx(0.15)    # seeds 0.1, 0.2
  assert table["fp32/pg"]["final_accuracy"]["se"] == pytest.approx(0.05)      # std 0.0707 / sqrt 2
  assert table["fp32/tis"]["seeds"] == [0, 1]
  verdict = open(paths["verdict"]).read()
  assert "fp32: tis 0.2 +- 0.05 > pg 0.15 +- 0.05" in verdict
  # Publishing: the verdict and table as they are, the figure downscaled to a palette PNG.
  out = publish.publish(str(tmp_path), "micro", str(tmp_path / "docs"))
  assert open(out["verdict.md"]).read() == verdict
  with Image.open(out["figure.png"]) as small, Image.open(paths["png"]) as full:
    assert small.mode == "P" and small.width == min(full.width, publish.MAX_WIDTH)
  # A written verdict survives publishing again; the numbers above it are the new ones.
  written = verdict.split("## Verdict\n")[0] + "## Verdict\n\nTIS > PG at 2 seeds (0.2 vs 0.15).\n"
  with open(out["verdict.md"], "w") as f:
    f.write(written.replace("fp32: tis", "OLD NUMBERS"))
  publish.publish(str(tmp_path), "micro", str(tmp_path / "docs"))
  again = open(out["verdict.md"]).read()
  assert again.endswith("## Verdict\n\nTIS > PG at 2 seeds (0.2 vs 0.15).\n")
  assert "fp32: tis 0.2 +- 0.05" in again and "OLD NUMBERS" not in again
  with pytest.raises(FileNotFoundError, match="no verdict.md, table.md, figure.png"):
    publish.publish(str(tmp_path / "fp32"), "micro", str(tmp_path / "docs"))


# Bounds on waiting for a signal handler or a child process: each event takes milliseconds (the
# handler runs as soon as the signal wakes the main thread; a `python -c` child starts in ~50 ms);
# 60 s holds on a machine many times slower than the slowest one measured, and a miss fails loudly
# instead of letting the test go on regardless.
WAIT_S = 60


@pytest.mark.parametrize("delivery", ["process", "other_thread", "main_masked"])
def test_a_signal_stops_the_study_its_run_checkpoints_and_the_rerun_resumes(tmp_path, monkeypatch, delivery):
  """SIGTERM to the runner mid-run: forwarded to the runs in progress (which checkpoint and exit 75),
  no further run starts, nothing is marked failed, `Preempted` reaches the caller; the rerun resumes
  the stopped run and finishes the rest.

  Issue 60: Python runs the handler on the main thread only. `other_thread` gives the signal to a
  bystander thread asleep on a lock (`pthread_kill`), as the kernel may give a process's signal to
  any thread that does not block it (the suite's workers hold tqdm's monitor thread): before
  `preempt.MainThreadWaiter` the runner's main thread, asleep until a run finished, ran the handler
  only then, so this run never saw it and the next one could start. `main_masked` enters the study
  with SIGTERM blocked on the main thread (and so on the runner's worker threads), as a library may
  leave it: before `preempt.signals_to_main_thread` no thread took the signal during the study. Both
  cases failed every time on the old runner (the handler had not run after WAIT_S).
  """
  p = runner.plan(studies.get("micro"), str(tmp_path))
  fake = FakeExecutor()
  forwarded, handled = [], threading.Event()

  def forward(signum):   # the handler's forwarding, on the main thread
    forwarded.append(signum)
    handled.set()
  monkeypatch.setattr(runner, "_forward", forward)

  def preempted_run(launch, log_path):
    if launch.kind == "run" and not forwarded:
      if delivery == "other_thread":
        signal.pthread_kill(bystander.ident, signal.SIGTERM)
      else:
        os.kill(os.getpid(), signal.SIGTERM)   # the runner's guard forwards it ...
      assert handled.wait(WAIT_S), "the runner's signal handler did not run while a run was in progress"
      with open(os.path.join(launch.workdir, "metrics.jsonl"), "w") as f:   # ... the run stops after step 1
        f.write(json.dumps({"step": 0, "eval_greedy_accuracy": 0.1}) + "\n")
        f.write(json.dumps({"step": 1, "reward": 0.1, "eval_greedy_accuracy": 0.1}) + "\n")
      return preempt.PREEMPTED_EXIT_CODE
    return fake(launch, log_path)
  # A thread asleep on a lock, as tqdm's monitor thread is in the suite's worker processes.
  bystander_done = threading.Event()
  bystander = threading.Thread(target=bystander_done.wait, daemon=True)
  bystander.start()
  masked = delivery == "main_masked"
  old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM] if masked else [])
  try:
    with pytest.raises(preempt.Preempted, match="SIGTERM"):
      runner.run_study(p, executor=preempted_run, progress=False)
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == old_mask | ({signal.SIGTERM} if masked else set())
  finally:
    signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
    bystander_done.set()
  assert forwarded == [signal.SIGTERM]
  assert [runner.status(launch) for launch in p.launches] == ["resume@1", "new", "new", "new"]
  assert not (tmp_path / "fp32/pg/seed0/failed.json").exists()
  counts = runner.run_study(p, executor=fake, progress=False)
  assert counts == {"skipped": 0, "ok": 4, "failed": 0, "preempted": 0}
  assert [runner.status(launch) for launch in p.launches] == ["done"] * 4


# A stand-in for `python -m rl_jax.main`: marks that it started (after installing its SIGTERM handler,
# as the trainer's guard does, unless `late`), then waits for the signal; on it, logs steps 0-1 and
# exits 75 as a checkpointed run does. Never signalled, it gives up after WAIT_S with exit 3.
_CHILD = """
import json, os, signal, sys, time
workdir, late = sys.argv[1], sys.argv[2] == "late"
def stop(signum, frame):
  with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
    f.write(json.dumps({"step": 0, "eval_greedy_accuracy": 0.1}) + "\\n")
    f.write(json.dumps({"step": 1, "reward": 0.1, "eval_greedy_accuracy": 0.1}) + "\\n")
  sys.exit(75)
if not late:
  signal.signal(signal.SIGTERM, stop)
open(os.path.join(workdir, "started"), "w").close()
time.sleep(%d)
sys.exit(3)
""" % WAIT_S


def _child_plan(tmp_path, late=False, warm_done=True):
  p = runner.plan(studies.get("micro"), str(tmp_path))
  mode = "late" if late else "ready"
  if warm_done:
    os.makedirs(p.warm_start.workdir)
    open(os.path.join(p.warm_start.workdir, runner.WARM_START_DONE), "w").close()
  else:
    p.warm_start = dataclasses.replace(p.warm_start, argv=(sys.executable, "-c", _CHILD, p.warm_start.workdir, mode))
  p.launches = [dataclasses.replace(launch, argv=(sys.executable, "-c", _CHILD, launch.workdir, mode))
                for launch in p.launches]
  return p


def _wait_for(paths):
  deadline = time.monotonic() + WAIT_S
  while not all(os.path.exists(x) for x in paths):
    assert time.monotonic() < deadline, f"not all of {paths} appeared within {WAIT_S} s"
    time.sleep(0.01)


@pytest.mark.parametrize("stage", ["runs", "warm_start"])
def test_preemption_contract_with_two_jobs_and_real_processes(tmp_path, stage):
  """Issue 60, `--jobs 2`: SIGTERM while two runs are in progress reaches both (each checkpoints and
  exits 75), the other two never start, nothing is marked failed. During the shared warm start the
  warm start is stopped the same way and no run starts."""
  p = _child_plan(tmp_path, warm_done=stage == "runs")
  if stage == "runs":
    first = [os.path.join(launch.workdir, "started") for launch in (p.launches[0], p.launches[2])]  # seed 0
  else:
    os.makedirs(p.warm_start.workdir)
    first = [os.path.join(p.warm_start.workdir, "started")]

  def signal_when_started():
    _wait_for(first)
    os.kill(os.getpid(), signal.SIGTERM)
  sender = threading.Thread(target=signal_when_started, daemon=True)
  sender.start()
  with pytest.raises(preempt.Preempted, match="SIGTERM"):
    runner.run_study(p, jobs=2, progress=False)
  sender.join(WAIT_S)
  started = [os.path.exists(os.path.join(launch.workdir, "started")) for launch in p.launches]
  if stage == "runs":
    assert [runner.status(launch) for launch in p.launches] == ["resume@1", "new", "resume@1", "new"]
    assert started == [True, False, True, False]
  else:
    assert runner.status(p.warm_start) == "new" and os.path.exists(os.path.join(p.warm_start.workdir, "metrics.jsonl"))
    assert not any(started) and [runner.status(launch) for launch in p.launches] == ["new"] * 4
  assert not list(tmp_path.glob("**/failed.json"))


def test_a_run_that_starts_as_the_study_stops_is_stopped_not_failed(tmp_path, monkeypatch):
  """Issue 60: the executor registers a run under the lock that records the stop. Registered first,
  it receives the forwarded signal; killed by it before it installed its own handler, it reads as
  preempted (exit 75), not failed. After the stop is recorded, nothing starts at all."""
  monkeypatch.setattr(runner, "_STOPPING", [])
  launch = _child_plan(tmp_path, late=True).launches[0]
  os.makedirs(launch.workdir)
  started = os.path.join(launch.workdir, "started")

  def stop_once_started():
    _wait_for([started])
    runner._stop(signal.SIGTERM)  # pylint: disable=protected-access
  stopper = threading.Thread(target=stop_once_started, daemon=True)
  stopper.start()
  assert runner.execute(launch, runner.subprocess_executor) == preempt.PREEMPTED_EXIT_CODE
  stopper.join(WAIT_S)
  assert runner.stopping() == signal.SIGTERM and not os.path.exists(os.path.join(launch.workdir, "failed.json"))
  os.remove(started)
  assert runner.subprocess_executor(launch, str(tmp_path / "log")) == preempt.PREEMPTED_EXIT_CODE
  assert not os.path.exists(started)


def test_launcher_prefixes_every_command(tmp_path):
  p = runner.plan(studies.get("micro"), str(tmp_path), launcher=("launch/local_multiprocess.sh", "2"))
  for launch in [p.warm_start] + p.launches:
    assert launch.argv[:2] == ("launch/local_multiprocess.sh", "2") and launch.argv[2].startswith("--config=")
    assert "-m" not in launch.argv and any(a.startswith("--workdir=") for a in launch.argv)


def test_nonfinite_abort_is_a_finished_collapse(tmp_path):
  p = runner.plan(studies.get("micro"), str(tmp_path), seeds=1)
  err = "FloatingPointError: non-finite loss or gradient at RL step 2, mini-batch 0"
  fake = FakeExecutor(crash={("fp32/pg", 0): err})
  assert runner.run_study(p, executor=fake, progress=False)["failed"] == 1
  assert runner.status(p.launches[0]) == "collapsed"
  assert json.load(open(tmp_path / "fp32/pg/seed0/failed.json"))["reason"] == artifacts.NON_FINITE
  fake.calls.clear()
  assert runner.run_study(p, executor=fake, progress=False)["skipped"] == 2
  assert fake.calls == []
  runner.aggregate_study(p)
  table = {row["name"]: row for row in json.load(open(tmp_path / "table.json"))}
  assert table["fp32/pg"]["collapse_steps"] == [2] and table["fp32/tis"]["collapse_steps"] == [None]


def test_dry_run_estimate_measures_finished_runs(tmp_path):
  p = runner.plan(studies.get("micro"), str(tmp_path), seeds=1, steps=40)
  per_run = runner.RUN_OVERHEAD_S + 40 * 8 * runner.STEP_S_PER_RESPONSE
  assert runner.estimate_s(p) == (pytest.approx(runner.WARM_START_S + 2 * per_run), pytest.approx(
      "constant STEP_S_PER_RESPONSE (no finished run measured yet)"))
  d = tmp_path / "fp32" / "pg" / "seed0"
  os.makedirs(d)
  with open(d / "metrics.jsonl", "w") as f:
    f.write(json.dumps({"step": 40, "reward": 0.0}) + "\n")
  with open(d / "summary.json", "w") as f:
    json.dump({"steps": 40}, f)
  with open(d / "study.json", "w") as f:
    json.dump({"steps": 40, "responses": 8, "wall_s": runner.RUN_OVERHEAD_S + 40 * 8 * 0.01}, f)
  total, source = runner.estimate_s(p)   # pg/seed0 is done; tis/seed0 at the measured 0.01 s
  assert total == pytest.approx(runner.WARM_START_S + runner.RUN_OVERHEAD_S + 40 * 8 * 0.01)
  assert source.startswith("measured over 1 finished runs")


def test_cli_lists_dry_run_and_commands(tmp_path, capsys):
  assert cli.main([]) == 0
  assert "fig3_weight_noise" in capsys.readouterr().out
  assert cli.main(["micro", "--root", str(tmp_path), "--dry_run"]) == 0
  out = capsys.readouterr().out
  assert "4 runs" in out and "estimated CPU time left" in out
  assert cli.main(["fig3_weight_noise", "--root", str(tmp_path), "--dry_run", "--panels", "noise_0.2"]) == 0
  out = capsys.readouterr().out
  assert "24 runs (8 configs x 3 seeds)" in out and "noise_0.1/" not in out and "noise_0.2/sc_tis/seed2" in out
  with pytest.raises(SystemExit):
    cli.main(["fig3_weight_noise", "--root", str(tmp_path), "--dry_run", "--panels", "noise_9"])
  assert "unknown panels ['noise_9']" in capsys.readouterr().err
  assert cli.main(["fig3_weight_noise", "--root", str(tmp_path), "--dry_run", "--panels", "noise_0.2",
                   "--lines", "pg,sc", "--seeds", "6"]) == 0
  out = capsys.readouterr().out
  assert "12 runs (2 configs x 6 seeds)" in out and "noise_0.2/sc/seed5" in out and "/tis/" not in out
  with pytest.raises(SystemExit):
    cli.main(["fig3_weight_noise", "--root", str(tmp_path), "--dry_run", "--lines", "sgd"])
  assert "unknown lines ['sgd']" in capsys.readouterr().err
  assert cli.main(["micro", "--root", str(tmp_path), "--print_commands", "--seeds", "1"]) == 0
  lines = [l for l in capsys.readouterr().out.splitlines() if not l.startswith("#")]
  assert len(lines) == 3 and all(shlex.split(l)[:3] == ["python", "-m", "rl_jax.main"] for l in lines)


@pytest.mark.slow
def test_micro_study_end_to_end(tmp_path):
  """The real micro grid (2 runs x 2 seeds x 2 steps + the warm start) through subprocesses, then a rerun."""
  env = dict(os.environ, PYTHONPATH=REPO)
  cmd = [sys.executable, "-m", "rl_jax.study", "micro", "--root", str(tmp_path)]
  subprocess.run(cmd, cwd=REPO, env=env, check=True)
  for k in ("figure.png", "table.md", "table.csv", "table.json", "verdict.md"):
    assert (tmp_path / k).exists()
  rerun = subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True, text=True)
  assert "0 ran, 4 already finished" in rerun.stdout


def test_verdict_names_the_command_that_runs_the_study():
  """Re-aggregating and publishing must not change the verdict's command into one that runs nothing."""
  argv = ["fig3_weight_noise", "--root", "R", "--panels", "noise_0.2", "--aggregate_only", "--publish", "docs/results",
          "--jobs", "2", "--publish=x"]
  assert cli._run_argv(argv) == ["fig3_weight_noise", "--root", "R", "--panels", "noise_0.2", "--jobs", "2"]  # pylint: disable=protected-access


@pytest.mark.slow  # ~6 min: the warm start and 4 tiny runs, each on 2 local processes
def test_micro_study_on_two_processes_per_run(tmp_path):
  """`--launcher 'launch/local_multiprocess.sh 2'`: the study's warm start (SFT) and every run on 2
  processes, to the same finished grid and verdict files as one process per run."""
  env = dict(os.environ, PYTHONPATH=REPO, DEVICES_PER_PROCESS="1", TIMEOUT_S="900")
  cmd = [sys.executable, "-m", "rl_jax.study", "micro", "--root", str(tmp_path),
         "--launcher", "launch/local_multiprocess.sh 2"]
  subprocess.run(cmd, cwd=REPO, env=env, check=True, timeout=1800)
  assert (tmp_path / "verdict.md").exists()
  log = (tmp_path / "fp32/pg/seed0/run.log").read_text()
  assert "[local_multiprocess] 2 processes" in log


@pytest.mark.slow   # a pip install into a temporary directory: ~20 s
def test_study_runner_plans_from_an_installed_package(tmp_path):
  """No source checkout needed: from a plain install (rl_jax with its configs as rl_jax.configs, nothing
  named `configs` at the top of site-packages) and another working directory, the runner finds the
  base configs and plans the runs."""
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  target = tmp_path / "site"
  subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                  "--target", str(target), repo], check=True, timeout=600)
  assert (target / "rl_jax" / "configs" / "common.py").exists() and not (target / "configs").exists()
  env = dict(os.environ, PYTHONPATH=str(target))
  out = subprocess.run([sys.executable, "-m", "rl_jax.study", "micro", "--root", str(tmp_path / "root"),
                        "--dry_run"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-2000:]
  assert "fp32/tis/seed1" in out.stdout
  import_path = subprocess.run([sys.executable, "-c", "import rl_jax; print(rl_jax.__file__)"], cwd=tmp_path,
                               env=env, capture_output=True, text=True, check=True).stdout
  assert import_path.startswith(str(target))   # the installed copy ran, not the checkout


def test_paper_figure_draws_a_study_in_the_papers_layout(tmp_path, monkeypatch):
  """rl_jax.study.paper_figures: panels / lines of the named study, 95% t shading; every figure names a study."""
  from rl_jax.study import paper_figures as pf
  for f in pf.FIGURES.values():
    s = studies.get(f.study)
    assert set(f.panels or ()) <= {k for k, _ in s.panels} and set(f.lines or ()) <= {k for k, _ in s.lines}
  assert np.isnan(pf._t975(np.array([1]))[0]) and pf._t975(np.array([3]))[0] == pytest.approx(4.302652729911275)
  p = runner.plan(studies.get("micro"), str(tmp_path))
  runner.run_study(p, executor=FakeExecutor(), progress=False)
  monkeypatch.setitem(pf.FIGURES, "micro_tis", pf.PaperFigure("micro: TIS only", "micro", lines=("tis",)))
  assert [g.name for g in pf.groups_for(pf.FIGURES["micro_tis"], str(tmp_path))] == ["fp32/tis"]
  out = pf.draw("micro_tis", str(tmp_path))
  assert out == str(tmp_path / "paper_micro_tis.png") and os.path.getsize(out) > 0
  assert pf.main(["micro_tis", "--root", str(tmp_path / "empty")]) != 0     # no finished run: a clear error


def test_a_study_carried_to_another_machine_runs_only_what_is_left(tmp_path):
  a, b = tmp_path / "machine_a", tmp_path / "machine_b"
  p = runner.plan(studies.get("micro"), str(a))
  fake = FakeExecutor(crash={("fp32/tis", 1): "killed"})
  runner.run_study(p, executor=fake, progress=False)
  with pytest.raises(SystemExit):   # nothing to pack before the warm start exists
    cli.main(["micro", "--root", str(tmp_path / "empty"), "--pack", str(tmp_path / "x.tgz")])
  arc = str(tmp_path / "micro.tgz")
  assert archive.pack(p, arc) == {"runs": 3, "left": 1, "skipped": 0}
  members = archive.unpack(arc, str(b))
  assert "warm_start/study_warm_start.json" in members and "fp32/pg/seed1/summary.json" in members
  assert not any(m.startswith("fp32/tis/seed1/") for m in members)   # unfinished: not carried
  q = runner.plan(studies.get("micro"), str(b))
  assert [runner.status(launch) for launch in q.launches] == ["done", "done", "done", "new"]
  fake.calls.clear()
  assert runner.run_study(q, executor=fake, progress=False)["ok"] == 1 and fake.calls == [("fp32/tis", 1)]
  archive.unpack(arc, str(b))   # the same files again: nothing differs
  # A second part, compacted: only the run finished since, no warm start; both parts rebuild the study.
  part2 = str(tmp_path / "micro_2.tgz")
  assert archive.pack(q, part2, compact=True, after=(arc,)) == {"runs": 1, "left": 0, "skipped": 3}
  c = tmp_path / "machine_c"
  assert cli.main(["micro", "--root", str(c), "--unpack", f"{arc},{part2}", "--dry_run"]) == 0
  r = runner.plan(studies.get("micro"), str(c))
  assert [runner.status(launch) for launch in r.launches] == ["done"] * 4
  rows = [json.loads(x) for x in open(c / "fp32/tis/seed1/metrics.jsonl")]
  assert rows and all(set(row) <= set(archive.compact_row(row)) for row in rows)
  assert archive.compact_row({"step": 1, "loss/weight_max": 2.0, "eval_greedy_accuracy": 0.5}) == {
      "step": 1, "eval_greedy_accuracy": 0.5}
  # Every column an analysis reads survives compaction.
  from rl_jax.analysis import aggregate, figures, precursors
  from rl_jax.study import protocol
  read = {aggregate.KL, aggregate.COSINE, aggregate.NORM_RATIO, *aggregate.EXTRA_MEANS, *precursors.PREDICTORS,
          precursors.EVENT_METRIC, protocol.ACCURACY, protocol.TRAIN_ACCURACY, protocol.KL, protocol.ROUTING,
          *(m for _, m in figures.METRICS)}
  assert all(archive.compact_row({k: 1.0}) == {k: 1.0} for k in read)
  with open(b / "fp32/pg/seed0/summary.json", "w") as f:
    f.write("{}")
  with pytest.raises(FileExistsError, match="differ"):
    archive.unpack(arc, str(b))
