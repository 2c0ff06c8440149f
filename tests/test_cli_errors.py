"""Command-line entry points: an expected failure prints one line naming what is wrong, exits 2 / 3 / 75."""
import json
import os
import subprocess
import sys

import pytest

from rl_jax import cli, preempt
from rl_jax.plan import cli as plan_cli
from rl_jax.plan import config as plan_config
from rl_jax.analysis import __main__ as analysis_cli
from rl_jax.analysis import attribution_report, precursors
from rl_jax.config_utils import ConfigError
from rl_jax.study import __main__ as study_cli
from rl_jax.workdir import LockHeldError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "configs", "countdown_tiny.py")


def exit_of(main, argv) -> int:
  """The exit code of `main(argv)`, whether it returns it or exits with it."""
  try:
    return main(argv)
  except SystemExit as e:
    return e.code


@pytest.fixture(autouse=True)
def _no_traceback_no_reexec(monkeypatch):
  monkeypatch.delenv(cli.TRACEBACK_ENV, raising=False)
  # plan re-execs itself unless the simulated device count already matches the config's mesh.
  monkeypatch.setenv(plan_cli._ENV_DEVICES, str(plan_config.mesh_size(plan_config.load_config(CONFIG).mesh, 1)))


def write_run(workdir):
  """An RL workdir with three metrics rows and no stored config."""
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
    for s in range(3):
      f.write(json.dumps({"step": s, "reward": 0.1 * s, "eval_greedy_accuracy": 0.1 * s}) + "\n")


def setup_tmp(tmp):
  """What the cases' {tmp} paths name: a file, an empty directory, one run, nothing matching 'none*'."""
  (tmp / "a_file").write_text("")
  (tmp / "empty").mkdir()
  write_run(tmp / "runs" / "a" / "seed0")


MAINS = {"study": study_cli.main, "plan": plan_cli.main, "analysis": analysis_cli.main,
         "precursors": precursors.main, "attribution": attribution_report.main}
C = "--config=configs/countdown_tiny.py"   # the tests run from the repo root
RUNS = "{tmp}/runs/*/seed*"
# (entry point, argv, exit code, what the last stderr line says); {tmp} is the test's tmp_path.
CASES = [
    ("study", ["nope"], 2, "invalid choice: 'nope'"),     # argparse's usage error, kept
    ("study", ["micro", "--dry_run", "--panels", "zzz"], 2, "unknown panels ['zzz']; panels: ['fp32']"),
    ("study", ["micro", "--dry_run", "--lines", "zzz"], 2, "unknown lines ['zzz']; lines: ['pg', 'tis']"),
    ("study", ["micro", "--jobs", "0"], 2, "--jobs 0: must be >= 1"),
    ("study", ["micro", "--root", "{tmp}/a_file"], 2, "Not a directory: '{tmp}/a_file/warm_start'"),
    ("study", ["micro", "--root", "{tmp}/empty", "--aggregate_only"], 2, "no run under {tmp}/empty logged"),
    ("plan", ["--config=configs/nope.py"], 2, "--config: no file 'configs/nope.py'"),
    ("plan", ["--config=README.md"], 2, "'README.md' is not a Python config file"),
    ("plan", ["--config=configs/common.py"], 2, "'configs/common.py' defines no get_config(arg)"),
    ("plan", [f"{C}:nonexistent_arg"], 2, "unknown config arg 'nonexistent_arg' (valid: 'test')"),
    ("plan", ["--config=configs/sweeps.py:off_policy/nope"], 2, "sweep 'off_policy' has no run 'nope'"),
    ("plan", [C, "--set", "rl.mode=x"], 2, "config key 'rl.mode': 'x' is not one of ['sync', 'async']"),
    ("plan", [C, "--set", "rl.stepz=3"], 2, "unknown config key 'rl.stepz' (closest: rl.steps"),
    ("plan", [C, "--set", "rl.mode"], 2, "--set 'rl.mode': expected KEY=VALUE"),
    ("plan", [C, "--set", "rl.steps.x=1"], 2, "'rl.steps' is a value, not a section"),
    ("plan", [C, "--set", "rl=1"], 2, "'rl' is a section; set one of its keys"),
    ("plan", [C, "--set", "foo.bar=1"], 2, "the config has no section 'foo'"),
    ("plan", [C, "--programs=zzz"], 2, "--programs: unknown ['zzz']; valid: sync,generate"),
    ("plan", [C, "--device=zzz"], 2, "--device 'zzz': not one of ['h100', 'h200', 'tpu_v5p']"),
    ("analysis", ["--workdirs", "{tmp}/none*", "--out", "{tmp}/o"], 2, "no directory with a metrics.jsonl"),
    ("analysis", ["--workdirs", RUNS, "--out", "{tmp}/o", "--group_by", "loss.method"], 2,
     "has no stored config (config.json)"),
    ("analysis", ["--workdirs", RUNS, "--out", "{tmp}/a_file"], 2, "File exists: '{tmp}/a_file'"),
    ("precursors", ["--workdirs", "{tmp}/none*"], 2, "no RL workdir with a metrics.jsonl matched"),
    ("precursors", ["--workdirs", "{tmp}/a_file"], 2, "no RL workdir with a metrics.jsonl matched"),
    ("attribution", ["--workdirs", RUNS, "--out", "{tmp}/o"], 2,
     "no run logged attribution/* (set rl.attribution_every)"),
]


@pytest.mark.parametrize("entry,argv,code,message", CASES,
                         ids=[f"{c[0]}-{' '.join(c[1])}" for c in CASES])
def test_expected_failure_is_one_line_naming_it_and_its_exit_code(entry, argv, code, message, tmp_path,
                                                                  capsys, monkeypatch):
  monkeypatch.chdir(REPO)
  setup_tmp(tmp_path)
  rc = exit_of(MAINS[entry], [a.format(tmp=tmp_path) for a in argv])
  err = capsys.readouterr().err
  assert rc == code, err
  assert "Traceback" not in err, err
  last = err.strip().splitlines()[-1]   # argparse prints its usage first; the error is the last line
  assert message.format(tmp=tmp_path) in last and last.startswith("python -m rl_jax."), err


def test_traceback_env_adds_the_traceback(capsys, monkeypatch):
  monkeypatch.chdir(REPO)
  for value, shown in (("1", True), ("0", False)):
    monkeypatch.setenv(cli.TRACEBACK_ENV, value)
    rc = exit_of(plan_cli.main, ["--config=configs/nope.py"])
    err = capsys.readouterr().err
    assert rc == 2 and "--config: no file 'configs/nope.py'" in err
    assert ("Traceback" in err) == shown, err


@pytest.mark.parametrize("error,code,message", [
    (ConfigError("config key 'rl.mode': bad"), 2, "error: config key 'rl.mode': bad"),
    (LockHeldError("workdir is in use"), 2, "error: workdir is in use"),
    (FileNotFoundError("no such workdir"), 2, "error: no such workdir"),
    (FloatingPointError("non-finite loss at step 3"), 3, "run error: non-finite loss at step 3"),
    (preempt.Preempted(4, 15, "/w"), preempt.PREEMPTED_EXIT_CODE, "preempted by SIGTERM: stopped after step"),
    (SystemExit("--flag: bad"), 2, "error: --flag: bad"),
])
def test_expected_errors_maps_each_type_to_its_code(error, code, message, capsys):
  @cli.expected_errors("prog")
  def failing():
    raise error
  with pytest.raises(SystemExit) as e:
    failing()
  err = capsys.readouterr().err
  assert e.value.code == code, err
  assert err.startswith(f"prog: {message}") and err.count("\n") == 1, err


@pytest.mark.parametrize("error", [KeyError("a bug"), AttributeError("a bug"), RuntimeError("a bug"),
                                   SystemExit(1), SystemExit(0)])
def test_anything_else_propagates_unchanged(error, capsys):
  with pytest.raises(type(error)) as e, cli.expected_errors("prog"):
    raise error
  assert e.value is error and capsys.readouterr().err == ""


def test_main_names_a_missing_config_file():
  r = subprocess.run([sys.executable, "-m", "rl_jax.main", "--config=configs/nope.py",
                      "--workdir=/tmp/unused"], cwd=REPO, capture_output=True, text=True, timeout=120,
                     env=dict(os.environ, JAX_PLATFORMS="cpu", RL_JAX_TRACEBACK=""))
  assert r.returncode == 2, r.stderr[-3000:]
  assert r.stderr.strip() == "config error: --config=configs/nope.py: [Errno 2] No such file or directory: " \
                             "'configs/nope.py'", r.stderr[-3000:]
