"""Run-state fault injections at library level: remote paths, the workdir lock, the stored config,
metrics on resume, wandb identity and credentials, and the corrupt-checkpoint fallback."""
import importlib
import json
import os
import socket
import subprocess
import sys
import types

import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax import metrics as metrics_lib
from rl_jax import workdir as wd
from rl_jax.checkpoint import Checkpointer
from rl_jax.config_utils import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = {"seed": 0, "loss": {"method": "minirl"}, "model": {"d": 8, "layers": (2, 2)},
       "rl": {"steps": 10, "eval_every": 5}, "logging": {"wandb_mode": "disabled"}}


def _cfg(**changes):
  cfg = json.loads(json.dumps(CFG))
  for key, value in changes.items():
    *parents, leaf = key.split("__")
    node = cfg
    for p in parents:
      node = node[p]
    node[leaf] = value
  return cfg


@pytest.fixture
def fake_gcs(monkeypatch):
  """`gs://` served offline by an in-memory fsspec filesystem under etils epath's fsspec backend."""
  from etils.epath import backend  # pylint: disable=g-import-not-at-top
  from fsspec.implementations.memory import MemoryFileSystem  # pylint: disable=g-import-not-at-top

  class FakeGCS(MemoryFileSystem):
    protocol = ("gs", "gcs")
    store: dict = {}
    pseudo_dirs = [""]

    @classmethod
    def _strip_protocol(cls, path):
      if isinstance(path, str) and path.startswith("gs://"):
        path = path[len("gs://"):]
      return MemoryFileSystem._strip_protocol(path)

  registry = importlib.import_module("fsspec.registry")
  monkeypatch.setitem(registry._registry, "gcs", FakeGCS)  # pylint: disable=protected-access
  backend.fsspec_backend._get_filesystem.cache_clear()  # pylint: disable=protected-access
  yield FakeGCS
  backend.fsspec_backend._get_filesystem.cache_clear()  # pylint: disable=protected-access


# -- one path abstraction ----------------------------------------------------------------------


def test_as_path_local_absolute_remote_kept_unknown_scheme_refused(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert os.fspath(wd.as_path("runs/a")) == str(tmp_path / "runs" / "a")
  assert os.fspath(wd.as_path("gs://bucket/x")) == "gs://bucket/x"
  with pytest.raises(ConfigError, match=r"'workdir'.*memory://"):
    wd.as_path("memory://x")
  with pytest.raises(ConfigError, match="'workdir': empty"):
    wd.as_path("")
  assert os.listdir(tmp_path) == []


def test_gs_workdir_run_state_and_metrics_make_no_local_directory(tmp_path, monkeypatch, fake_gcs):
  monkeypatch.chdir(tmp_path)
  run = wd.RunDir.open("gs://bucket/x", _cfg())
  assert os.fspath(run.path("metrics.jsonl")) == "gs://bucket/x/metrics.jsonl"
  writer = metrics_lib.MetricsWriter("gs://bucket/x", metrics_lib.LoggingConfig(wandb_mode="disabled"),
                                     run_id=run.run_id, restored_step=None)
  for step in range(4):
    writer.write(step, {"reward": step / 2})
  writer.close()
  assert metrics_lib.truncate_metrics("gs://bucket/x", 2) == 1
  assert [r["step"] for r in metrics_lib.read_metrics("gs://bucket/x")] == [0, 1, 2]
  run.close()
  stored = json.loads(wd.as_path("gs://bucket/x/run.json").read_text())
  assert stored["identity"]["run_id"] == run.run_id and stored["config"]["seed"] == 0
  assert not wd.as_path("gs://bucket/x/workdir.lock").exists()
  assert "/bucket/x/metrics.jsonl" in fake_gcs.store
  assert os.listdir(tmp_path) == []  # no ./gs:/bucket/x


def test_checkpointer_hands_orbax_the_remote_path(tmp_path, monkeypatch):
  # Orbax's gs:// I/O needs google-cloud-storage and tensorstore's GCS driver (network), so only
  # the path handed to it is checked here.
  seen = {}

  class FakeManager:
    def __init__(self, directory, options=None):
      seen["directory"] = directory

  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr("orbax.checkpoint.CheckpointManager", FakeManager)
  ckpt = Checkpointer("gs://bucket/x", subdir="checkpoints")
  assert os.fspath(seen["directory"]) == "gs://bucket/x/checkpoints"
  assert os.fspath(ckpt.corrupt_dir) == "gs://bucket/x/checkpoints.corrupt"
  assert os.listdir(tmp_path) == []


# -- the workdir lock --------------------------------------------------------------------------


def _holder_process(workdir):
  """A second python process that takes the lock and waits for stdin to close."""
  code = ("import sys; from rl_jax import workdir as wd; r = wd.RunDir.open(sys.argv[1], {}); "
          "print('locked', flush=True); sys.stdin.read(); r.close()")
  proc = subprocess.Popen([sys.executable, "-c", code, str(workdir)], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True, cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=REPO))
  assert proc.stdout.readline().strip() == "locked"
  return proc


def test_second_process_fails_at_once_naming_holder_then_lock_is_released(tmp_path):
  proc = _holder_process(tmp_path)
  try:
    with pytest.raises(wd.LockHeldError, match=rf"host '{socket.gethostname()}' pid {proc.pid}"):
      wd.RunDir.open(tmp_path, _cfg())
  finally:
    proc.stdin.close()
    proc.wait(timeout=30)
  assert not (tmp_path / wd.LOCK_NAME).exists()
  wd.RunDir.open(tmp_path, _cfg()).close()


def test_same_process_cannot_open_twice(tmp_path):
  run = wd.RunDir.open(tmp_path, _cfg())
  with pytest.raises(wd.LockHeldError, match=f"pid {os.getpid()}"):
    wd.RunDir.open(tmp_path, _cfg())
  run.close()


def test_stale_lock_of_a_dead_process_is_taken_over(tmp_path, capsys):
  dead = subprocess.Popen([sys.executable, "-c", "pass"])
  dead.wait()
  (tmp_path / wd.LOCK_NAME).write_text(json.dumps(
      {"host": socket.gethostname(), "pid": dead.pid, "time": "then", "token": "old"}))
  run = wd.RunDir.open(tmp_path, _cfg())
  assert "stale lock" in capsys.readouterr().out
  assert json.loads((tmp_path / wd.LOCK_NAME).read_text())["pid"] == os.getpid()
  assert [p.name for p in tmp_path.iterdir() if "stale" in p.name] == []
  run.close()


def test_reused_pid_does_not_keep_a_dead_runs_lock(tmp_path, capsys):
  """A restarted container can give the new process the dead holder's pid, or give that pid to
  another live process: the boot id / start time tell them apart (Linux)."""
  if wd._proc_start(os.getpid()) is None:  # pylint: disable=protected-access
    pytest.skip("no /proc")
  lock = tmp_path / wd.LOCK_NAME
  lock.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "token": "old"}))
  wd.RunDir.open(tmp_path, _cfg()).close()  # our own pid, but not a lock this process took
  assert "stale lock" in capsys.readouterr().out
  live = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
  try:
    start = wd._proc_start(live.pid)  # pylint: disable=protected-access
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": live.pid, "start": start}))
    with pytest.raises(wd.LockHeldError, match=f"pid {live.pid}"):
      wd.RunDir.open(tmp_path, _cfg())
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": live.pid, "start": "1"}))
    wd.RunDir.open(tmp_path, _cfg()).close()  # that pid is another process now
    assert "stale lock" in capsys.readouterr().out
  finally:
    live.stdin.close()
    live.wait(timeout=30)


def test_lock_from_another_host_is_not_taken_over(tmp_path):
  (tmp_path / wd.LOCK_NAME).write_text(json.dumps(
      {"host": "other-host", "pid": 1, "time": "then", "token": "t"}))
  with pytest.raises(wd.LockHeldError, match=r"host 'other-host' pid 1.*delete"):
    wd.RunDir.open(tmp_path, _cfg())


def test_non_writer_process_takes_no_lock_and_writes_nothing(tmp_path):
  run = wd.RunDir.open(tmp_path / "w", _cfg(), is_writer=False)
  assert run.lock is None and not (tmp_path / "w").exists()
  writer_run = wd.RunDir.open(tmp_path / "w", _cfg())  # the writer is not blocked by it
  writer_run.close()


def test_workdir_that_is_a_file_or_not_creatable_names_the_key(tmp_path):
  f = tmp_path / "file"
  f.write_text("x")
  with pytest.raises(ConfigError, match="'workdir'.*not a directory"):
    wd.RunDir.open(f, _cfg())
  with pytest.raises(ConfigError, match="'workdir'.*cannot create"):
    wd.RunDir.open(f / "sub", _cfg())


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root ignores permissions")
def test_read_only_workdir_names_the_key(tmp_path):
  ro = tmp_path / "ro"
  ro.mkdir()
  ro.chmod(0o555)
  try:
    with pytest.raises(ConfigError, match="'workdir'.*not writable"):
      wd.RunDir.open(ro, _cfg())
  finally:
    ro.chmod(0o755)


# -- run identity and the stored config --------------------------------------------------------


def _fake_checkpoint(root, step=4):
  (root / "checkpoints" / str(step)).mkdir(parents=True)


def test_changed_config_fails_listing_keys_safe_keys_pass_force_overrides(tmp_path):
  first = wd.RunDir.open(tmp_path, _cfg())
  first.close()
  _fake_checkpoint(tmp_path)
  bad = _cfg(seed=1, loss__method="grpo", rl__steps=20)
  with pytest.raises(ConfigError) as e:
    wd.RunDir.open(tmp_path, bad)
  msg = str(e.value)
  assert "2 key(s)" in msg and "seed: 0 -> 1" in msg and "loss.method: 'minirl' -> 'grpo'" in msg
  assert "rl.steps" not in msg.split("(safe to change")[0]
  assert not (tmp_path / wd.LOCK_NAME).exists()  # a failed open releases the lock

  safe = wd.RunDir.open(tmp_path, _cfg(rl__steps=20, rl__eval_every=2, logging__wandb_mode="offline"))
  assert safe.resuming and safe.run_id == first.run_id
  assert [k for k, _, _ in safe.changed] == ["logging.wandb_mode", "rl.eval_every", "rl.steps"]
  safe.close()

  forced = wd.RunDir.open(tmp_path, dict(bad, resume="force"), resume="force")
  assert forced.run_id == first.run_id
  forced.close()
  stored = json.loads((tmp_path / wd.RUN_NAME).read_text())
  assert stored["config"]["seed"] == 1 and "seed" in stored["history"][-1]["changed"]


def test_run_json_records_the_environment_and_a_resume_on_another(tmp_path, monkeypatch):
  """Issue 53: run.json names the jax / jaxlib versions, the CPU model and the XLA flags; a resume
  under another environment appends it to the history, an unchanged one writes nothing."""
  import importlib.metadata  # pylint: disable=g-import-not-at-top
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --some_flag=1")
  wd.RunDir.open(tmp_path, _cfg()).close()
  env = json.loads((tmp_path / wd.RUN_NAME).read_text())["environment"]
  assert env["packages"]["jax"] == importlib.metadata.version("jax")
  assert env["packages"]["jaxlib"] == importlib.metadata.version("jaxlib")
  assert env["xla_flags"] == "--xla_force_host_platform_device_count=8 --some_flag=1" and env["cpu"]
  _fake_checkpoint(tmp_path)
  wd.RunDir.open(tmp_path, _cfg()).close()
  assert json.loads((tmp_path / wd.RUN_NAME).read_text())["history"] == []
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  wd.RunDir.open(tmp_path, _cfg()).close()
  (entry,) = json.loads((tmp_path / wd.RUN_NAME).read_text())["history"]
  assert entry["changed"] == [] and entry["environment"]["xla_flags"] == "--xla_force_host_platform_device_count=8"
  wd.RunDir.open(tmp_path, _cfg()).close()   # the same again: compared with the latest, nothing new
  assert len(json.loads((tmp_path / wd.RUN_NAME).read_text())["history"]) == 1


def test_a_key_the_stored_config_lacks_compares_as_the_default_the_caller_passes(tmp_path):
  """Issue 40: RunDir takes the job's schema defaults as an argument (it imports no schema)."""
  wd.RunDir.open(tmp_path, _cfg()).close()
  _fake_checkpoint(tmp_path)
  newer = _cfg(loss__new_key=0.5)  # a key added to the schema after the run started
  with pytest.raises(ConfigError, match=r"loss.new_key: '<absent>' -> 0.5"):
    wd.RunDir.open(tmp_path, newer)
  wd.RunDir.open(tmp_path, newer, defaults={"loss.new_key": 0.5}).close()
  with pytest.raises(ConfigError, match=r"loss.new_key: 0.25 -> 0.5"):
    wd.RunDir.open(tmp_path, newer, defaults={"loss.new_key": 0.25})


def test_model_shape_change_is_caught_before_restore(tmp_path):
  wd.RunDir.open(tmp_path, _cfg()).close()
  _fake_checkpoint(tmp_path)
  with pytest.raises(ConfigError, match=r"model.layers: \[2, 2\] -> \[2, 3\]"):
    wd.RunDir.open(tmp_path, _cfg(model__layers=(2, 3)))


def test_bad_resume_value_names_the_key(tmp_path):
  with pytest.raises(ConfigError, match="'resume'.*'maybe'"):
    wd.RunDir.open(tmp_path / "fresh", _cfg(), resume="maybe")
  assert not (tmp_path / "fresh").exists()
  wd.RunDir.open(tmp_path, _cfg()).close()
  _fake_checkpoint(tmp_path)
  with pytest.raises(ConfigError, match="'resume'.*'maybe'"):
    wd.RunDir.open(tmp_path, _cfg(), resume="maybe")


def test_new_experiment_in_reused_path_gets_new_identity(tmp_path):
  a = wd.RunDir.open(tmp_path, _cfg())
  a.close()
  b = wd.RunDir.open(tmp_path, _cfg(seed=5))  # nothing checkpointed: a fresh run
  b.close()
  assert not b.resuming and b.run_id != a.run_id
  assert json.loads((tmp_path / wd.RUN_NAME).read_text())["config"]["seed"] == 5


def test_non_writer_runs_the_same_check(tmp_path):
  wd.RunDir.open(tmp_path, _cfg()).close()
  _fake_checkpoint(tmp_path)
  with pytest.raises(ConfigError, match="seed"):
    wd.RunDir.open(tmp_path, _cfg(seed=3), is_writer=False)


# -- metrics on resume -------------------------------------------------------------------------

_NO_WANDB = metrics_lib.LoggingConfig(wandb_mode="disabled")


def test_resume_after_kill_past_a_checkpoint_writes_each_step_once(tmp_path):
  w = metrics_lib.MetricsWriter(tmp_path, _NO_WANDB, restored_step=None)
  for step in range(7):  # killed after step 6, last checkpoint at 4
    w.write(step, {"reward": float(step)})
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 7, "rew')  # torn line of the kill
  w = metrics_lib.MetricsWriter(tmp_path, _NO_WANDB, restored_step=4)
  for step in range(5, 9):
    w.write(step, {"reward": 10.0 + step})
  w.close()
  rows = metrics_lib.read_metrics(tmp_path)
  assert [r["step"] for r in rows] == list(range(9))
  assert [r["reward"] for r in rows] == [0, 1, 2, 3, 4, 15, 16, 17, 18]


def test_fresh_run_clears_rows_of_an_attempt_that_never_checkpointed(tmp_path):
  (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
  metrics_lib.MetricsWriter(tmp_path, _NO_WANDB, restored_step=None).write(0, {"a": 1})
  assert metrics_lib.read_metrics(tmp_path) == [{"step": 0, "a": 1}]


def test_truncation_is_atomic(tmp_path, monkeypatch):
  path = tmp_path / "metrics.jsonl"
  text = "".join(json.dumps({"step": s}) + "\n" for s in range(5))
  path.write_text(text)

  def crash(self, target):
    raise KeyboardInterrupt("killed before the rename")

  monkeypatch.setattr(type(wd.as_path(path)), "replace", crash)
  with pytest.raises(KeyboardInterrupt):
    metrics_lib.truncate_metrics(tmp_path, 2)
  assert path.read_text() == text  # the old file, whole


def test_wandb_run_id_comes_from_the_stored_identity(tmp_path, monkeypatch):
  calls = []
  fake = types.SimpleNamespace(init=lambda **kw: calls.append(kw) or types.SimpleNamespace(
      log=lambda *a, **k: None, finish=lambda: None))
  monkeypatch.setitem(sys.modules, "wandb", fake)
  monkeypatch.delenv("WANDB_MODE", raising=False)
  cfg = metrics_lib.LoggingConfig(wandb_mode="offline")
  first = wd.RunDir.open(tmp_path, _cfg())
  first.close()
  metrics_lib.MetricsWriter(tmp_path, cfg, restored_step=None).close()  # id read from run.json
  metrics_lib.MetricsWriter(tmp_path, cfg, run_id=first.run_id, restored_step=None).close()
  second = wd.RunDir.open(tmp_path, _cfg())  # same path, nothing checkpointed: a new experiment
  second.close()
  metrics_lib.MetricsWriter(tmp_path, cfg, run_id=second.run_id, restored_step=None).close()
  assert [c["id"] for c in calls] == [first.run_id, first.run_id, second.run_id]
  assert first.run_id != second.run_id and all(c["resume"] == "allow" for c in calls)


def test_online_without_credentials_falls_back_to_offline(tmp_path):
  env = {"HOME": str(tmp_path)}
  with pytest.warns(UserWarning, match="no wandb credentials"):
    assert metrics_lib.resolve_wandb_mode("online", env) == "offline"
  assert metrics_lib.resolve_wandb_mode("online", dict(env, WANDB_API_KEY="k")) == "online"
  (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password secret\n")
  assert metrics_lib.resolve_wandb_mode("online", env) == "online"
  assert metrics_lib.resolve_wandb_mode("online", dict(env, WANDB_MODE="disabled")) == "disabled"
  with pytest.raises(ValueError, match="logging.wandb_mode"):
    metrics_lib.resolve_wandb_mode("onlin", env)


# -- corrupt checkpoint fallback ---------------------------------------------------------------


def _tiny(v):
  return {"params": {"w": jnp.full((8, 8), v, jnp.float32)}, "opt_state": {"count": jnp.int32(v)}}


def _truncate(step_dir, which):
  """Cuts a file of the step in half (what a full disk or a kill leaves): the params' OCDBT data
  file (orbax: OUT_OF_RANGE) or the JSON metadata item."""
  if which == "data":
    (path,) = list((step_dir / "params" / "d").iterdir())
  else:
    path = step_dir / "meta" / "metadata"
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) // 2)


@pytest.mark.parametrize("which", ["data", "meta"])
def test_corrupt_latest_checkpoint_falls_back_and_is_moved_aside(tmp_path, capsys, which):
  ckpt = Checkpointer(tmp_path)
  for step in (2, 4):
    ckpt.save(step, _tiny(step), {"step": step})
  ckpt.close()
  _truncate(tmp_path / "checkpoints" / "4", which)
  files_before = sorted(os.path.relpath(os.path.join(r, f), tmp_path / "checkpoints" / "4")
                        for r, _, fs in os.walk(tmp_path / "checkpoints" / "4") for f in fs)
  ckpt = Checkpointer(tmp_path)
  items, meta, step = ckpt.restore(_tiny(0))
  assert step == 2 and meta == {"step": 2}
  np.testing.assert_array_equal(np.asarray(items["params"]["w"]), np.full((8, 8), 2.0))
  assert ckpt.latest_step() == 2
  out = capsys.readouterr().out
  assert "step 4" in out and "falling back to step 2" in out
  (moved,) = list((tmp_path / "checkpoints.corrupt").iterdir())
  assert moved.name.startswith("4-") and not (tmp_path / "checkpoints" / "4").exists()
  assert sorted(os.path.relpath(os.path.join(r, f), moved)
                for r, _, fs in os.walk(moved) for f in fs) == files_before  # nothing deleted
  ckpt.save(6, _tiny(6), {"step": 6})  # the run goes on from the fallback
  assert ckpt.latest_step() == 6
  ckpt.close()


def test_no_checkpoint_restores_raises_and_moves_nothing(tmp_path):
  ckpt = Checkpointer(tmp_path)
  ckpt.save(2, _tiny(2), {"step": 2})
  ckpt.close()
  ckpt = Checkpointer(tmp_path)
  wrong = {"params": {"w": jnp.zeros((4, 4))}, "opt_state": {"count": jnp.int32(0)}}
  with pytest.raises(Exception):  # a shape mismatch fails on every step: nothing is corrupt
    ckpt.restore(wrong)
  ckpt.close()
  assert (tmp_path / "checkpoints" / "2").is_dir() and not (tmp_path / "checkpoints.corrupt").exists()


def test_reader_checkpointer_leaves_a_mistyped_path_uncreated(tmp_path):
  ckpt = Checkpointer(tmp_path / "typo", create=False)
  assert ckpt.latest_step() is None
  with pytest.raises(FileNotFoundError, match="no checkpoint"):
    ckpt.restore(_tiny(0))
  ckpt.close()
  assert not (tmp_path / "typo").exists()


# -- the same faults through the RL job (configs/countdown_tiny.py:test) ------------------------
# Tests that only need the job to reach (or not reach) its first compute patch that compute to
# raise `Computed`; the two that need real checkpoints replace the sampler/update step and the
# evaluation with cheap fakes, so what runs is the job's loop, checkpoints and metrics.

from rl_jax.configs import countdown_tiny  # pylint: disable=g-import-not-at-top,wrong-import-position
from rl_jax.rl import trainer as trainer_lib  # pylint: disable=g-import-not-at-top,wrong-import-position
from rl_jax.study import sweeps  # pylint: disable=g-import-not-at-top,wrong-import-position


class Computed(Exception):
  """Raised by the patched first compute: the job got past every check."""


def _job_config(**overrides):
  cfg = countdown_tiny.get_config("test")
  cfg.warm_start.source = "none"
  cfg.mesh.tensor = 2  # 8 test devices: fsdp 4 x tensor 2
  return sweeps.apply_overrides(cfg, overrides)


@pytest.fixture
def no_compute(monkeypatch):
  """Parameter init and the warm start raise Computed: reaching them means every check passed."""
  seen = []

  def computed(*args, **kwargs):
    seen.append(args)
    raise Computed("compute reached")
  monkeypatch.setattr(trainer_lib.train_state, "init_params", computed)
  monkeypatch.setattr(trainer_lib, "warm_start", computed)
  return seen


@pytest.fixture
def fake_steps(monkeypatch):
  """train_step / evaluate replaced by step-dependent fakes (`attempt` tags a run's rows)."""
  state = {"attempt": 0, "die_at": None}

  def train_step(self, step):
    if step == state["die_at"]:
      raise InjectedKill(f"killed during step {step + 1}")
    return {"reward": 0.1 * step, "mismatch/kl_k1": 10.0 * state["attempt"] + step,
            "attempt": state["attempt"]}

  monkeypatch.setattr(trainer_lib.RLTrainer, "train_step", train_step)
  monkeypatch.setattr(trainer_lib.RLTrainer, "evaluate", lambda self: {"eval_greedy_accuracy": 0.5})
  return state


class InjectedKill(RuntimeError):
  pass


def test_job_resume_after_kill_between_checkpoints_writes_each_step_once(tmp_path, monkeypatch,
                                                                         fake_steps, fast_compile):
  """Item 5 (+ 11): killed after step 3 with the last checkpoint at 2; the resumed job drops the
  killed attempt's step-3 row, so every step appears once and the summary's mean counts each once;
  both attempts log to the wandb run of the workdir's stored identity."""
  calls = []
  fake = types.SimpleNamespace(init=lambda **kw: calls.append(kw) or types.SimpleNamespace(
      log=lambda *a, **k: None, finish=lambda: None))
  monkeypatch.setitem(sys.modules, "wandb", fake)
  monkeypatch.delenv("WANDB_MODE", raising=False)
  cfg = lambda: _job_config(**{"rl.steps": 4, "rl.checkpoint_every": 2, "rl.eval_every": 4,
                               "logging.wandb_mode": "offline"})
  fake_steps["die_at"] = 3  # steps 1..3 written, checkpoint at 2
  with pytest.raises(InjectedKill):
    trainer_lib.run(cfg(), tmp_path)
  assert [r["step"] for r in metrics_lib.read_metrics(tmp_path)] == [0, 1, 2, 3]
  assert not (tmp_path / wd.LOCK_NAME).exists()  # released on the way out
  fake_steps.update(attempt=1, die_at=None)
  summary = trainer_lib.run(cfg(), tmp_path)
  rows = metrics_lib.read_metrics(tmp_path)
  assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
  assert [r.get("attempt") for r in rows] == [None, 0, 0, 1, 1]
  assert summary["mean_kl_k1"] == pytest.approx(np.mean([0, 1, 12, 13]))
  assert json.loads((tmp_path / "summary.json").read_text()) == summary
  run_id = json.loads((tmp_path / wd.RUN_NAME).read_text())["identity"]["run_id"]
  assert [c["id"] for c in calls] == [run_id, run_id]


def test_job_on_a_locked_workdir_fails_before_compute_naming_the_holder(tmp_path, no_compute):
  """Item 6."""
  holder = wd.RunDir.open(tmp_path, {})
  try:
    with pytest.raises(wd.LockHeldError, match=rf"host '{socket.gethostname()}' pid {os.getpid()}"):
      trainer_lib.RLTrainer(_job_config(), tmp_path)
  finally:
    holder.close()
  assert no_compute == [] and not (tmp_path / "checkpoints").exists()


def _started_workdir(root, cfg):
  """A workdir as the job leaves it after its first checkpoint: run.json + a step directory."""
  wd.RunDir.open(root, cfg.to_dict()).close()
  (root / "checkpoints" / "1").mkdir(parents=True)


def test_job_changed_config_fails_before_compute_listing_keys(tmp_path, no_compute):
  """Item 7: seed, loss.method and the model shape listed; rl.steps may change; resume=force."""
  _started_workdir(tmp_path, _job_config())
  bad = {"seed": 1, "loss.method": "tis", "model.d_model": 48}
  with pytest.raises(ConfigError) as e:
    trainer_lib.RLTrainer(_job_config(**bad), tmp_path)
  msg = str(e.value)
  assert "3 key(s)" in msg and "seed: 0 -> 1" in msg and "loss.method: 'pg' -> 'tis'" in msg
  assert "model.d_model: 32 -> 48" in msg
  assert no_compute == [] and not (tmp_path / wd.LOCK_NAME).exists()
  with pytest.raises(Computed):  # a longer run resumes
    trainer_lib.RLTrainer(_job_config(**{"rl.steps": 30}), tmp_path)
  with pytest.raises(Computed):
    trainer_lib.RLTrainer(_job_config(**{"seed": 1, "resume": "force"}), tmp_path)
  assert json.loads((tmp_path / wd.RUN_NAME).read_text())["config"]["seed"] == 1
  assert not (tmp_path / wd.LOCK_NAME).exists()


def test_resume_key_is_in_the_configs_so_the_flag_override_works():
  """`--config.resume=force` needs the key (config flags cannot add one)."""
  assert countdown_tiny.get_config().resume == "check"
  assert sweeps.apply_overrides(_job_config(), {"resume": "force"}).resume == "force"


def test_job_resumes_from_the_previous_checkpoint_when_the_latest_is_corrupt(tmp_path, capsys,
                                                                             fake_steps, fast_compile):
  """Item 8."""
  cfg = lambda: _job_config(**{"rl.steps": 2, "rl.checkpoint_every": 1})
  trainer_lib.run(cfg(), tmp_path)
  _truncate(tmp_path / "checkpoints" / "2", "data")
  capsys.readouterr()
  with trainer_lib.RLTrainer(cfg(), tmp_path) as tr:
    assert tr.start_step == 1
  out = capsys.readouterr().out
  assert "falling back to step 1" in out and "resumed from step 1" in out
  (moved,) = list((tmp_path / "checkpoints.corrupt").iterdir())
  assert moved.name.startswith("2-") and not (tmp_path / "checkpoints" / "2").exists()


def test_job_remote_workdir_goes_through_epath_and_makes_no_local_dir(tmp_path, monkeypatch, fake_gcs,
                                                                      no_compute):
  """Item 9: run.json and the lock on the (fake) bucket, the warm start under it, no ./gs: dir."""
  class FakeManager:
    def __init__(self, directory, options=None):
      self.directory = directory

    def latest_step(self):
      return None

    def close(self):
      pass

  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr("orbax.checkpoint.CheckpointManager", FakeManager)
  with pytest.raises(Computed):
    trainer_lib.RLTrainer(_job_config(), "gs://bucket/run")
  (args,) = no_compute
  assert args[2] == "gs://bucket/run/warm_start"  # warm_start(job, config, path, mesh)
  stored = json.loads(wd.as_path("gs://bucket/run/run.json").read_text())
  assert stored["config"]["seed"] == 0
  assert not wd.as_path("gs://bucket/run/workdir.lock").exists()
  assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("overrides, key", [
    ({"sampler.max_prompt_len": 8}, "sampler.max_prompt_len"),
    ({"warm_start.source": "auto", "sft.max_len": 12}, "sft.max_len"),
    ({"warm_start.source": "auto", "sft.bogus": 1}, "sft.bogus"),
    ({"rl.group_size": 1, "rl.prompts_per_step": 8}, "rl.group_size"),
    ({"warm_start.source": "hf", "warm_start.path": ""}, "warm_start.path"),
])
def test_job_config_errors_fail_before_compute(tmp_path, no_compute, overrides, key):
  """Item 10: errors that used to surface after SFT or compilation; nothing is created."""
  cfg = _job_config()
  cfg.unlock()
  for k, v in overrides.items():
    node = cfg
    *parents, leaf = k.split(".")
    for p in parents:
      node = node[p]
    node[leaf] = v
  with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
    trainer_lib.RLTrainer(cfg, tmp_path / "w")
  assert no_compute == [] and not (tmp_path / "w").exists()


def test_job_sft_section_is_checked_although_the_warm_start_exists(tmp_path, no_compute):
  """Item 10: an 'auto' warm start already made still has its config section validated."""
  cfg = _job_config(**{"warm_start.source": "auto", "sft.batch_size": 0})
  (tmp_path / "w" / "warm_start" / "checkpoints" / "12").mkdir(parents=True)
  with pytest.raises(ConfigError, match=r"sft\.batch_size"):
    trainer_lib.RLTrainer(cfg, tmp_path / "w")
  assert no_compute == []


def test_job_warm_start_path_typo_is_named_and_not_created(tmp_path, no_compute):
  """Item 10: source=sft with a mistyped path fails before compute and leaves no junk dir."""
  typo = tmp_path / "sft_rnu"
  with pytest.raises(ConfigError, match=r"warm_start\.path.*no SFT checkpoint"):
    trainer_lib.RLTrainer(_job_config(**{"warm_start.source": "sft", "warm_start.path": str(typo)}),
                          tmp_path / "w")
  assert not typo.exists() and no_compute == []
  with pytest.raises(ConfigError, match=r"warm_start\.path.*config\.json"):
    trainer_lib.RLTrainer(_job_config(**{"warm_start.source": "hf", "warm_start.path": str(typo)}),
                          tmp_path / "w")
  assert not typo.exists()


def test_job_workdir_that_is_a_file_or_read_only_fails_before_compute(tmp_path, no_compute):
  """Item 10."""
  f = tmp_path / "file"
  f.write_text("x")
  with pytest.raises(ConfigError, match="'workdir'.*not a directory"):
    trainer_lib.RLTrainer(_job_config(), f)
  if not (hasattr(os, "geteuid") and os.geteuid() == 0):  # root ignores permissions
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
      with pytest.raises(ConfigError, match="'workdir'.*not writable"):
        trainer_lib.RLTrainer(_job_config(), ro)
    finally:
      ro.chmod(0o755)
  assert no_compute == []


def test_job_wandb_online_without_credentials_warns_before_compute(tmp_path, monkeypatch, no_compute):
  """Item 10: the fallback to offline is decided (and said) before any compute."""
  monkeypatch.delenv("WANDB_MODE", raising=False)
  monkeypatch.delenv("WANDB_API_KEY", raising=False)
  monkeypatch.setenv("HOME", str(tmp_path))
  monkeypatch.delenv("NETRC", raising=False)
  with pytest.warns(UserWarning, match="no wandb credentials"):
    with pytest.raises(Computed):
      trainer_lib.RLTrainer(_job_config(**{"logging.wandb_mode": "online"}), tmp_path / "w")
