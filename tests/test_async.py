"""Async RL: sync == async at zero lag, lags, the drop policy, busy fractions, resume with nothing in flight lost."""
import json
import os
import signal
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from rl_jax import preempt
from rl_jax.checkpoint import Checkpointer
from rl_jax.config_utils import ConfigError
from rl_jax.configs import countdown_tiny
from rl_jax.metrics import read_metrics
from rl_jax.rl import inflight as inflight_lib
from rl_jax.rl import trainer as trainer_lib
from rl_jax.study import sweeps

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
  on 4 devices (the same programs on same-shaped meshes). Evaluation off (rl.eval_size=0): no eval
  row is written and no eval program compiled (the async loop's evaluation is the fixture's below)."""
  steps = {"rl.steps": 2, "rl.eval_size": 0}
  sync_cfg = _config(**steps, **{"mesh.num_devices": 4})
  async_cfg = _config(**steps, **ASYNC, **{"rl.max_staleness": 0})
  trainer_lib.run(sync_cfg, str(tmp_path / "sync"))
  trainer_lib.run(async_cfg, str(tmp_path / "async"))
  assert _equal(_params(tmp_path / "sync", sync_cfg)[1], _params(tmp_path / "async", async_cfg)[1])
  assert [r["async/lag"] for r in _train_rows(tmp_path / "async")] == [0.0, 0.0]
  assert not any(k.startswith("eval") for r in read_metrics(str(tmp_path / "async")) for k in r)
  # Both run the sync loop: generation, then the trainer, each waited for before the next
  # program is dispatched, so their busy intervals never overlap.
  for workdir in (tmp_path / "sync", tmp_path / "async"):
    for r in _train_rows(workdir):
      assert 0 < r["async/sampler_busy"] <= 1 and 0 < r["async/trainer_busy"] <= 1, r
      assert r["async/busy_overlap"] == 0.0, r
      assert r["async/sampler_busy"] + r["async/trainer_busy"] <= 1 + 1e-9, r


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
  # The async loop evaluates at the start and at the end (clean weights, the sampler's devices).
  evals = [r["step"] for r in read_metrics(str(uninterrupted)) if "eval_greedy_accuracy" in r]
  assert evals == [0, 4] and 0 <= summary["final_eval_greedy_accuracy"] <= 1
  # 'wait': nothing dropped; the sampler took the trainer's weights before each of the two
  # generations dispatched ahead (steps 0, 1; steps 2, 3 have nothing left to generate).
  assert [r["async/dropped"] for r in rows] == [0.0] * 4
  assert [r["async/waits"] for r in rows] == [1.0, 1.0, 0.0, 0.0]
  assert summary["async_dropped_total"] == 0 and summary["async_waits_total"] == 2
  np.testing.assert_allclose(sum(summary["lag_token_share"].values()), 1.0, rtol=1e-6)


def test_busy_fractions_of_the_async_loop(uninterrupted):
  """Steps 0 and 1 dispatch the generation of step s + 2 on devices 0-3 before the updates on 4-7;
  steps 2, 3 generate nothing, so no sampler time at all. Whether the two groups' intervals
  overlap is not asserted: on shared CPU cores the generation can be done before the host has
  dispatched the p_old forward (runs recorded overlaps of 0 to 0.2 of a step)."""
  rows = _train_rows(uninterrupted)
  for r in rows:
    for key in ("async/sampler_busy", "async/trainer_busy", "async/busy_overlap"):
      assert 0 <= r[key] <= 1, r
    assert r["async/busy_overlap"] <= min(r["async/sampler_busy"], r["async/trainer_busy"]) + 1e-12, r
    assert r["async/trainer_busy"] > 0, r
  assert all(r["async/sampler_busy"] > 0 for r in rows[:2]), rows
  assert [r["async/sampler_busy"] for r in rows[2:]] == [0.0, 0.0]
  summary = json.loads((uninterrupted / "summary.json").read_text())
  assert 0 <= summary["busy_overlap_mean"] <= summary["sampler_busy_mean"] <= 1


def _preempted_in_step_1(config, workdir, monkeypatch) -> preempt.Preempted:
  """Runs `config` with a SIGTERM delivered while step 1 trains; returns the Preempted it raised."""
  real = trainer_lib.RLTrainer.train_on

  def signal_during_step_1(self, item, t0, t1):
    if item.step == 1:
      os.kill(os.getpid(), signal.SIGTERM)
    return real(self, item, t0, t1)
  with monkeypatch.context() as m:
    m.setattr(trainer_lib.RLTrainer, "train_on", signal_during_step_1)
    with pytest.raises(preempt.Preempted) as err:
      trainer_lib.run(config, str(workdir))
  return err.value


def test_sigterm_checkpoints_the_step_and_rollouts_in_flight_and_resume_matches(tmp_path, uninterrupted,
                                                                                monkeypatch):
  """A SIGTERM during step 1 (of 4, no checkpoint due): the step finishes, step 2 is saved with the
  two rollouts generated ahead (steps 2, 3) and `Preempted` is raised; the resumed run trains each
  prompt once and ends on the uninterrupted run's parameters bit for bit."""
  workdir = tmp_path / "preempted"
  assert _preempted_in_step_1(_config(**ONE_OFF), workdir, monkeypatch).step == 2
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
  target = {"generation": "rollout", "between_generate_and_update": "train_on", "save": "save"}[phase]
  real = getattr(trainer_lib.RLTrainer, target)

  def crash(self, *args):
    step = args[0].step if hasattr(args[0], "step") else args[0]
    if step == {"rollout": 3, "train_on": 2, "save": 3}[target]:
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


# -- rl.stale_policy='drop' ----------------------------------------------------------------------

def test_stale_rule_and_the_pipeline_schedule():
  assert not inflight_lib.is_stale(0, 1) and not inflight_lib.is_stale(1, 1) and inflight_lib.is_stale(2, 1)
  assert not inflight_lib.is_stale(0, 0) and inflight_lib.is_stale(1, 0)
  assert [inflight_lib.pipeline_version(s, 1) for s in range(4)] == [0, 1, 2, 3]   # 'wait'
  assert [inflight_lib.pipeline_version(s, 3) for s in range(7)] == [0, 0, 0, 3, 3, 3, 6]
  # K = 1, S = 2: the rollout of t (dispatched at t - 1) lags K + (t - K) mod S; t = 2, 4 drop.
  lags = [t - inflight_lib.pipeline_version(t - 1, 2) for t in range(1, 6)]
  assert lags == [1, 2, 1, 2, 1]
  assert [inflight_lib.is_stale(lag, 1) for lag in lags] == [False, True, False, True, False]


def test_busy_interval_arithmetic():
  assert inflight_lib.union_length([(0, 1), (0.5, 2), (3, 4)], 0, 10) == 3
  assert inflight_lib.union_length([(-1, 1), (9, 12)], 0, 10) == 2   # clipped to the window
  assert inflight_lib.overlap_length([(0, 1), (2, 3)], [(1, 2)], 0, 10) == 0.0   # touching only
  assert inflight_lib.overlap_length([(0, 2)], [(1, 3), (1.5, 4)], 0, 3.5) == 1.0
  # A program "dispatched" at t0, waited for by the host: busy from t0 to the host's observation.
  clock = inflight_lib.BusyClock()
  t0 = time.perf_counter()
  x = clock.track("trainer", jax.numpy.ones(8) * 2, t0)
  float(x[0])
  clock.observed("trainer", x)
  seen = time.perf_counter() - t0
  frac = clock.fractions(t0, t0 + 2 * seen)
  assert 0 < frac["async/trainer_busy"] <= 0.5 and frac["async/sampler_busy"] == 0.0
  assert frac["async/busy_overlap"] == 0.0
  assert clock.fractions(t0, t0 + 1.0)["async/trainer_busy"] == 0.0   # fractions() starts a new window


def test_stale_policy_config_errors_name_the_key():
  with pytest.raises(ConfigError, match="rl.stale_policy"):
    trainer_lib.RLJob.from_config(_config(**ASYNC, **{"rl.stale_policy": "skip"}))
  with pytest.raises(ConfigError, match="rl.stale_policy"):   # the sync loop has nothing in flight
    trainer_lib.RLJob.from_config(_config(**{"rl.stale_policy": "drop"}))
  with pytest.raises(ConfigError, match="rl.stale_policy"):   # K = 0 runs the sync loop
    trainer_lib.RLJob.from_config(_config(**ASYNC, **{"rl.stale_policy": "drop", "rl.max_staleness": 0}))
  with pytest.raises(ConfigError, match="rl.sampler_sync_every"):
    trainer_lib.RLJob.from_config(_config(**ASYNC, **{"rl.sampler_sync_every": 2}))
  with pytest.raises(ConfigError, match="rl.sampler_sync_every"):
    trainer_lib.RLJob.from_config(_config(**ASYNC, **{"rl.stale_policy": "drop", "rl.sampler_sync_every": 0}))
  job = trainer_lib.RLJob.from_config(_config(**ASYNC, **{"rl.stale_policy": "drop", "rl.sampler_sync_every": 2}))
  assert (job.rl.stale_policy, job.rl.sampler_sync_every) == ("drop", 2)


# K = 1 and a sampler refreshed every 2 steps: the rollout of step 2 is generated at step 1 by
# version 0 (lag 2 > K) and dropped; steps 1 and 3 arrive at lag 1.
DROP = {**ASYNC, "rl.max_staleness": 1, "rl.stale_policy": "drop", "rl.sampler_sync_every": 2,
        "rl.p_old_version": "rollout", "rl.steps": 4, "rl.eval_size": 0, "rl.checkpoint_every": 10}


def _prompt_key(row, pad_id):
  return tuple(int(t) for t in row if t != pad_id)


@pytest.fixture(scope="module")
def dropped(tmp_path_factory):
  """The drop run, with what it trained (step, version, prompt rows) and every stale check."""
  workdir = tmp_path_factory.mktemp("dropped")
  trained, checks, stream = [], [], []
  real_train, real_stale = trainer_lib.RLTrainer.train_on, inflight_lib.is_stale

  def record_train(self, item, t0, t1):
    if not stream:  # the run's whole prompt stream, in order, each prompt once per group member
      b, g, pad = self.job.rl.prompts_per_step, self.job.rl.group_size, self.job.sampler.pad_id
      _, ids, _ = self.prompts(0, count=self.job.rl.steps * b, start=0)
      stream.extend(_prompt_key(r, pad) for r in np.asarray(ids) for _ in range(g))
    prompts = np.asarray(jax.device_get(item.ro.tokens_BS))[:, :item.ro.prompt_len]
    trained.append((item.step, item.version, [_prompt_key(r, self.job.sampler.pad_id) for r in prompts]))
    return real_train(self, item, t0, t1)

  def record_stale(lag, k):
    checks.append((lag, real_stale(lag, k)))
    return checks[-1][1]
  with pytest.MonkeyPatch.context() as m:
    m.setattr(trainer_lib.RLTrainer, "train_on", record_train)
    m.setattr(inflight_lib, "is_stale", record_stale)
    trainer_lib.run(_config(**DROP), str(workdir))
  return workdir, trained, checks, stream


def test_drop_discards_the_stale_rollout_and_trains_each_prompt_once(dropped):
  workdir, trained, checks, stream = dropped
  # Each step checks the rollout it would train: step 2's (generated by version 0) lags 2 > K.
  assert checks == [(0, False), (1, False), (2, True), (1, False)]
  rows = _train_rows(workdir)
  assert [r["async/lag"] for r in rows] == [0.0, 1.0, 0.0, 1.0]   # every trained lag <= K
  assert [r["async/dropped"] for r in rows] == [0.0, 0.0, 1.0, 0.0]
  # Generations that waited for the trainer's weights: the refreshes at steps 0, 2 and step 2's
  # regeneration (step 3 generates nothing ahead).
  assert [r["async/waits"] for r in rows] == [1.0, 0.0, 2.0, 0.0]
  # The regenerated rollout is version 2's; steps 1, 3 come from the refreshes at steps 0, 2.
  assert [(s, v) for s, v, _ in trained] == [(0, 0), (1, 0), (2, 2), (3, 2)]
  # Each prompt of the stream trained exactly once, in order (the dropped copy never reached the trainer).
  assert [p for _, _, prompts in trained for p in prompts] == stream
  # p_old at the rollout's version: a clean fp32 sampler matches it at every lag, so the version
  # each rollout was tagged with is the one that generated it.
  for r in rows:
    assert abs(r["mismatch/kl_k1"]) < 1e-6, r
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["async_dropped_total"] == 1 and summary["async_waits_total"] == 3
  assert summary["lag_steps"] == {"0": 2, "1": 2}


@pytest.mark.slow  # ~1.5 min: a second drop run and its resume
def test_drop_resume_matches_the_uninterrupted_run(tmp_path, dropped, monkeypatch):
  """SIGTERM in step 1: step 2 is saved with step 2's rollout in flight (version 0, to be dropped)
  and the sampler's weights of version 0; the resume drops it as the uninterrupted run did and
  ends on its parameters bit for bit."""
  workdir = tmp_path / "preempted"
  _preempted_in_step_1(_config(**DROP), workdir, monkeypatch)
  trainer_lib.run(_config(**DROP), str(workdir))
  rows, want = _train_rows(workdir), _train_rows(dropped[0])
  for key in ("step", "async/lag", "async/dropped", "async/waits"):
    assert [r[key] for r in rows] == [r[key] for r in want], key
  assert _equal(_params(dropped[0], _config(**DROP))[1], _params(workdir, _config(**DROP))[1])
