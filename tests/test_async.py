"""Async RL: sync == async at zero lag, versions and lags, and preemption / crash resume with nothing in flight lost."""
import json
import os
import signal

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from configs import countdown_tiny
from configs import sweeps
from rl_jax import preempt
from rl_jax.checkpoint import Checkpointer
from rl_jax.config_utils import ConfigError
from rl_jax.metrics import read_metrics
from rl_jax.rl import trainer as trainer_lib

ASYNC = {"rl.mode": "async", "mesh.sampler_devices": 4}


def _config(**overrides):
  """The `:test` config from random init; 8 test devices, tensor 2 (sync) or 4 + 4 split (async)."""
  cfg = countdown_tiny.get_config("test")
  cfg.warm_start.source = "none"
  cfg.mesh.tensor = 2
  return sweeps.apply_overrides(cfg, overrides)


def _params(workdir, cfg):
  with trainer_lib.RLTrainer(sweeps.apply_overrides(cfg, {"resume": "force"}), str(workdir)) as tr:
    return tr.start_step, jax.tree.map(np.asarray, tr.state["params"])


def _equal(a, b):
  return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _train_rows(workdir):
  return [r for r in read_metrics(str(workdir)) if "reward" in r]


def test_async_at_zero_lag_equals_sync_bit_for_bit(tmp_path):
  """max_staleness 0: the sampler on devices 0-3 and the trainer on 4-7 give the sync loop's params
  on 4 devices (the same programs on same-shaped meshes)."""
  steps = {"rl.steps": 2, "rl.eval_every": 2}
  sync_cfg = _config(**steps, **{"mesh.num_devices": 4})
  async_cfg = _config(**steps, **ASYNC, **{"rl.max_staleness": 0})
  trainer_lib.run(sync_cfg, str(tmp_path / "sync"))
  trainer_lib.run(async_cfg, str(tmp_path / "async"))
  assert _equal(_params(tmp_path / "sync", sync_cfg)[1], _params(tmp_path / "async", async_cfg)[1])
  assert [r["async/lag"] for r in _train_rows(tmp_path / "async")] == [0.0, 0.0]


ONE_OFF = {**ASYNC, "rl.max_staleness": 2, "rl.p_old_version": "rollout", "rl.steps": 4,
           "rl.eval_every": 4, "rl.checkpoint_every": 10}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("uninterrupted")
  trainer_lib.run(_config(**ONE_OFF), str(workdir))
  return workdir


def test_lags_and_p_old_at_the_rollout_version(uninterrupted):
  """K = 2: steps 0-1 train on version 0 (lags 0, 1), later steps lag 2. With a clean fp32 sampler
  and p_old at the rollout's version the train/inference KL is ~0 at every lag, and the staleness
  shows in p/p_old instead: 1 at lag 0, far from it at lags 1 and 2."""
  rows = _train_rows(uninterrupted)
  assert [r["async/lag"] for r in rows] == [0.0, 1.0, 2.0, 2.0]
  for r in rows:
    assert abs(r["mismatch/kl_k1"]) < 1e-6, r
  # 1 up to float32 rounding at lag 0 (p_old and p come from two compiled programs, a few ulps).
  np.testing.assert_allclose(rows[0]["loss/staleness_ratio_max"], 1.0, rtol=0, atol=2e-6)
  for r in rows[1:]:
    assert r["loss/staleness_ratio_max"] > 1.1, r  # the lagged versions' policy moved
  summary = json.loads((uninterrupted / "summary.json").read_text())
  assert summary["lag_steps"] == {"0": 1, "1": 1, "2": 2}
  np.testing.assert_allclose(sum(summary["lag_token_share"].values()), 1.0, rtol=1e-6)


def test_sigterm_checkpoints_the_step_and_rollouts_in_flight_and_resume_matches(tmp_path, uninterrupted,
                                                                                monkeypatch):
  """A SIGTERM during step 1 (of 4, no checkpoint due): the step finishes, step 2 is saved with the
  two rollouts generated ahead (steps 2, 3) and `Preempted` is raised; the resumed run trains each
  prompt once and ends on the uninterrupted run's parameters bit for bit."""
  workdir = tmp_path / "preempted"
  real = trainer_lib.RLTrainer._train_on

  def signal_during_step_1(self, item, t0, t1):
    if item.step == 1:
      os.kill(os.getpid(), signal.SIGTERM)
    return real(self, item, t0, t1)
  with monkeypatch.context() as m:
    m.setattr(trainer_lib.RLTrainer, "_train_on", signal_during_step_1)
    with pytest.raises(preempt.Preempted) as err:
      trainer_lib.run(_config(**ONE_OFF), str(workdir))
  assert err.value.step == 2
  ckpt = Checkpointer(str(workdir), create=False)
  assert ckpt.manager.all_steps() == [2]
  meta = ckpt.manager.restore(2, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
  ckpt.close()
  assert meta["inflight_steps"] == [2, 3] and meta["inflight_versions"] == [0, 1]
  trainer_lib.run(_config(**ONE_OFF), str(workdir))
  assert [r["step"] for r in _train_rows(workdir)] == [1, 2, 3, 4]
  assert [r["async/lag"] for r in _train_rows(workdir)] == [0.0, 1.0, 2.0, 2.0]
  s_a, a = _params(uninterrupted, _config(**ONE_OFF))
  s_b, b = _params(workdir, _config(**ONE_OFF))
  assert s_a == s_b == 4 and _equal(a, b)


class InjectedCrash(RuntimeError):
  pass


@pytest.mark.slow  # ~1 min each; the SIGTERM test above covers the in-flight checkpoint by default
@pytest.mark.parametrize("phase", ["generation", "between_generate_and_update", "save"])
def test_crash_in_any_phase_resumes_to_the_uninterrupted_params(tmp_path, uninterrupted, monkeypatch, phase):
  """A crash while generating step 3's rollout (in step 1), between step 2's rollout and its update,
  or in the middle of step 3's save: the resume restarts from the last checkpoint with its rollouts
  in flight and ends on the uninterrupted parameters, each step trained once."""
  workdir = tmp_path / phase
  cfg = _config(**{**ONE_OFF, "rl.checkpoint_every": 1})
  target = {"generation": "rollout", "between_generate_and_update": "_train_on", "save": "save"}[phase]
  real = getattr(trainer_lib.RLTrainer, target)

  def crash(self, *args):
    step = args[0].step if hasattr(args[0], "step") else args[0]
    if step == {"rollout": 3, "_train_on": 2, "save": 3}[target]:
      if phase == "save":  # killed mid-write: orbax's unfinalized directory holds a partial file
        tmp = self.ckpt.directory / f"{step}.orbax-checkpoint-tmp-0"
        tmp.mkdir(parents=True)
        (tmp / "partial").write_bytes(b"\0" * 100)
      raise InjectedCrash(phase)
    return real(self, *args)
  with monkeypatch.context() as m:
    m.setattr(trainer_lib.RLTrainer, target, crash)
    with pytest.raises(InjectedCrash):
      trainer_lib.run(cfg, str(workdir))
  trainer_lib.run(cfg, str(workdir))
  assert [r["step"] for r in _train_rows(workdir)] == [1, 2, 3, 4]
  assert _equal(_params(uninterrupted, cfg)[1], _params(workdir, cfg)[1])


def test_async_config_errors_name_the_key():
  with pytest.raises(ConfigError, match="rl.staleness"):
    trainer_lib.RLJob.from_config(_config(**ASYNC, **{"rl.staleness": 2}))
  with pytest.raises(ConfigError, match="rl.p_old_version"):
    trainer_lib.RLJob.from_config(_config(**{"rl.p_old_version": "rollout"}))
  with pytest.raises(ConfigError, match="mesh.sampler_devices"):
    trainer_lib.RLTrainer(_config(**{"mesh.sampler_devices": 4}), "/nonexistent/never_created")
  with pytest.raises(ConfigError, match="mesh.sampler_devices"):
    trainer_lib.RLTrainer(_config(**{**ASYNC, "mesh.sampler_devices": 3}), "/nonexistent/never_created")
