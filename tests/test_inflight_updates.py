"""In-flight weight updates: the chunked engine equals one program, per-token versions, token lags, the async loop."""
import functools
import json
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from conftest import run_clean_and_killed
from rl_jax import preempt
from rl_jax.checkpoint import Checkpointer
from rl_jax.config_utils import ConfigError
from rl_jax import sharding as sh
from rl_jax import train_state
from rl_jax.configs import countdown_tiny
from rl_jax.metrics import read_metrics
from rl_jax.models.config import ModelConfig
from rl_jax.models.kv_cache import init_cache
from rl_jax.models.transformer import Transformer
from rl_jax.rl import inflight_updates
from rl_jax.rl import trainer as trainer_lib
from rl_jax.rollout import repeat_prompts
from rl_jax.sampler import chunked
from rl_jax.sampler import continuous
from rl_jax.sampler import generate as gen
from rl_jax.sampler.config import SamplerConfig
from rl_jax.study import sweeps

V, P, T = 64, 8, 10
FIELDS = ("tokens_BS", "positions_BS", "prompt_mask_BS", "response_mask_BS", "logq_BT", "topk_ids_BTK",
          "topk_logq_BTK", "head_mass_BT", "expert_ids_BSLK", "expert_valid_BS", "lengths_B",
          "prompt_lengths_B", "trunc_thresh_BT", "trunc_logmass_BT", "trunc_size_BT")


def _model(moe: bool, seed: int = 0, invariant: bool = False):
  cfg = ModelConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64,
                    n_experts=4 if moe else 0, n_experts_per_tok=2, moe_d_ff=32, init_std=0.2,
                    tie_embeddings=False, batch_invariant=invariant)
  return nnx.split(Transformer(cfg, rngs=nnx.Rngs(seed)))


def _prompts(lengths, seed=7):
  rng = np.random.default_rng(seed)
  toks = np.zeros((len(lengths), P), np.int32)
  valid = np.zeros((len(lengths), P), bool)
  for i, n in enumerate(lengths):
    toks[i, :n] = rng.integers(2, V, n)
    valid[i, :n] = True
  return repeat_prompts((toks, valid), 2)


# The chunked engine's test rollout: 4 slots for 12 rows, chunks of 3 iterations, chunked refill prefill,
# two decode phases (cache slots 16 from step 0, 18 from step 9).
ENGINE = dict(max_prompt_len=P, max_new_tokens=T, temperature=1.5, top_k=24, record_topk=8, eos_id=5,
              engine="continuous", slots=4, prefill_chunk=3, decode_phases=2, min_phase_steps=1)


def _chunked(graphdef, states, toks, valid, key, cfg, chunk, max_new_B=None):
  """Chunks of `chunk` iterations, chunk i sampled by states[min(i, -1)] recorded as version 10 + i."""
  carry = chunked.start(graphdef, states[0], toks, valid, key, cfg, version=10, n_iters=chunk, max_new_B=max_new_B)
  i = 0
  while chunked.unfinished(carry):
    i += 1
    carry = chunked.advance(graphdef, states[min(i, len(states) - 1)], carry, cfg, version=10 + i, n_iters=chunk)
  return chunked.finish(carry, cfg), i


@pytest.mark.slow  # compiles the one-program and the chunked engine: ~10 s dense on an idle CPU
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_chunked_engine_equals_one_program_and_records_versions(moe):
  """(1) Weights that never change: the rollout cut into chunks of 3 iterations (4 slots for 12
  rows: refills from the queue, chunked refill prefill; top-k sampling, per-row length limits) is
  `generate`'s, every record bit for bit, outside the batch-invariant mode too (the same iterations
  in the same order). (2) New weights from the second chunk on: versions never decrease along a
  row; the rows of the first slots decode token j at iteration j, so it carries chunk j // 3's
  version; the tokens before the boundary are the old weights' exactly, the ones after are not."""
  graphdef, state = _model(moe)
  _, state_b = _model(moe, seed=1)
  toks, valid = _prompts([3, 7, 5, 1, 6, 2])
  key = jax.random.key(4)
  c, n = 3, 4
  cfg = SamplerConfig(**ENGINE)
  assert cfg.slots == n and continuous.phase_slots(cfg) == (16, 18)  # chunks cut inside both decode phases
  max_new_B = np.array([T, 3, T, T, 5, T, 1, T, T, 7, T, T], np.int32)
  one = gen.generate(graphdef, state, toks, valid, key, cfg, max_new_B=max_new_B)
  ro, chunks = _chunked(graphdef, [state], toks, valid, key, cfg, c, max_new_B)
  assert chunks >= 3, chunks  # the rollout did cross chunk boundaries
  for f in FIELDS:
    a, b = getattr(one, f), getattr(ro, f)
    assert (a is None) == (b is None), f
    if a is not None:
      np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=f)
  assert one.version_BT is None and ro.version_BT is not None

  mixed, _ = _chunked(graphdef, [state, state_b], toks, valid, key, cfg, c, max_new_B)
  version_BT, mask_BT = np.asarray(mixed.version_BT), np.asarray(mixed.response_mask_BT)
  assert (version_BT[~mask_BT] == 0).all()
  assert (np.diff(np.where(mask_BT, version_BT, version_BT.max()), axis=1) >= 0).all()
  want_T = 10 + np.arange(T) // c
  np.testing.assert_array_equal(version_BT[:n], np.where(mask_BT[:n], want_T, 0))
  np.testing.assert_array_equal(np.asarray(mixed.response_BT)[:n, :c], np.asarray(one.response_BT)[:n, :c])
  np.testing.assert_array_equal(np.asarray(mixed.logq_BT)[:n, :c], np.asarray(one.logq_BT)[:n, :c])
  assert not np.array_equal(np.asarray(mixed.logq_BT)[:n, c:], np.asarray(one.logq_BT)[:n, c:])


MAX_NEW_B = np.array([T, 3, T, T, 5, T, 1, T, T, 7, T, T], np.int32)


def _host(tree):
  return jax.tree.map(lambda x: np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(
      x.dtype, jax.dtypes.prng_key) else x), tree)


def test_reprefill_progress_holds_no_kv_cache():
  """What a checkpoint keeps of a rollout in generation under `rl.inflight_resume='reprefill'`
  (abstract, nothing compiles): the carry less its KV cache and the laid-out inputs (the response
  slots of the tokens only), so no array of the cache's shapes and a fraction of its bytes."""
  graphdef, state = _model(True)
  toks, valid = _prompts([3, 7, 5, 1, 6, 2])
  cfg = SamplerConfig(**ENGINE)
  carry = jax.eval_shape(functools.partial(chunked._start, graphdef, cfg=cfg, kv_spec=gen.resolve_kv_spec(None, cfg),  # pylint: disable=protected-access
                                           mesh=None), state, toks, valid, jax.random.key(0), None, jnp.int32(0),
                         jnp.int32(1))
  prog = chunked.progress_shapes(carry, cfg)
  assert set(prog) == (set(carry) - set(continuous.DERIVED) - {"tokens_BS"}) | {"response_BT"}
  assert prog["response_BT"].shape == (12, T)
  cache = jax.eval_shape(lambda: init_cache(nnx.merge(graphdef, state).cfg, 4, P + T, jnp.float32))
  cache_shapes = {x.shape for x in jax.tree.leaves(cache)}
  assert cache_shapes == {x.shape for x in jax.tree.leaves(carry["cache"])}
  assert not cache_shapes & {x.shape for x in jax.tree.leaves(prog)}
  nbytes = lambda t: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(t))
  assert nbytes(prog) < nbytes(carry) - nbytes(carry["cache"])


@pytest.mark.slow  # compiles the chunked engine, the re-prefill and the one-program engine: ~20 s per model
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_reprefill_rebuilds_the_engine_cache_bit_for_bit(moe):
  """At every chunk boundary of the chunked engine's test rollout (slots decoding, ended, refilled
  from the queue, and part-way through their prompt's chunked prefill), the carry rebuilt from its
  progress (`chunked.progress`, then `chunked.resume`: the prompts laid out again, every live slot's
  prompt and partial response re-prefilled) by the same weights, in the batch-invariant mode, holds
  the engine's KV cache bit for bit at every cache slot a live row has written, and the rest of the
  carry exactly; continued to the end, it is the one-program rollout bit for bit. Re-prefilled by
  other weights, the cache differs and no record does: nothing generated is regenerated."""
  graphdef, state = _model(moe, invariant=True)
  _, state_b = _model(moe, seed=1, invariant=True)
  toks, valid = _prompts([3, 7, 5, 1, 6, 2])
  key = jax.random.key(4)
  cfg = SamplerConfig(**ENGINE)
  one = gen.generate(graphdef, state, toks, valid, key, cfg, max_new_B=MAX_NEW_B)
  carry = chunked.start(graphdef, state, toks, valid, key, cfg, version=0, n_iters=3, max_new_B=MAX_NEW_B)
  seen, i = set(), 0
  while chunked.unfinished(carry):
    i += 1
    want = _host(carry)
    prog = chunked.progress(carry, cfg)
    got = _host(chunked.resume(graphdef, state, toks, valid, key, prog, cfg, max_new_B=MAX_NEW_B))
    written_NS = np.asarray(continuous.written_slots(want, cfg=cfg))
    k_at = lambda kv: np.where(written_NS[:, None, None], kv.k, 0)  # k [N, G, D, S]
    v_at = lambda kv: np.where(written_NS[:, None, :, None], kv.v, 0)  # v [N, G, S, D]
    for a, b in zip(want["cache"], got["cache"]):
      np.testing.assert_array_equal(k_at(b), k_at(a))
      np.testing.assert_array_equal(v_at(b), v_at(a))
    for k in want:
      if k != "cache":
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    live, ready = want["live_N"], want["ready_N"]
    seen |= {"ended" if not l else "prefilling" if not r else "decoding" for l, r in zip(live, ready)}
    if want["next_row"] > 4:
      seen.add("refilled")
    ro = chunked.finish(chunked.advance(graphdef, state, chunked.resume(graphdef, state, toks, valid, key, prog, cfg,
                                                                         max_new_B=MAX_NEW_B), cfg, version=1), cfg)
    for f in FIELDS:
      if getattr(one, f) is not None:
        np.testing.assert_array_equal(np.asarray(getattr(ro, f)), np.asarray(getattr(one, f)), err_msg=f)
    if i == 3:  # other weights: the cache is theirs, the records are the carry's
      other = _host(chunked.resume(graphdef, state_b, toks, valid, key, prog, cfg, max_new_B=MAX_NEW_B))
      assert written_NS.any() and not np.array_equal(v_at(other["cache"][0]), v_at(want["cache"][0]))
      for k in ("tokens_BS", "logq_BT", "topk_logq_BTK", "version_BT", "experts_BSLK"):
        if want[k] is not None:
          np.testing.assert_array_equal(other[k], want[k], err_msg=k)
    carry = chunked.advance(graphdef, state, carry, cfg, version=1, n_iters=3)
  assert i >= 5 and seen == {"ended", "prefilling", "decoding", "refilled"}, (i, seen)


def test_token_lag_metrics_by_hand():
  """Trainer at step 7, two rows: versions [5 5 6 7 | -] and [6 7 - - | -] (- = no token): lags
  2 2 1 0 1 0 -> mean 1, max 2, shares 2/6, 2/6, 2/6, 0 at lags 0..3."""
  version_BT = np.array([[5, 5, 6, 7, 0], [6, 7, 0, 0, 0]])
  mask_BT = np.array([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]], bool)
  m = inflight_updates.token_lag_metrics(version_BT, mask_BT, step=7, max_lag=3)
  assert m["async/token_lag_mean"] == 1.0 and m["async/token_lag_max"] == 2.0
  assert [m[f"async/token_lag_share/{l}"] for l in range(4)] == [2 / 6, 2 / 6, 2 / 6, 0.0]


# -- the async loop -----------------------------------------------------------------------------

ASYNC = {"rl.mode": "async", "mesh.sampler_devices": 4, "sampler.engine": "continuous"}


def _config(**overrides):
  cfg = countdown_tiny.get_config("test")
  cfg.warm_start.source = "none"
  cfg.mesh.tensor = 2
  return sweeps.apply_overrides(cfg, overrides)


def test_config_errors_name_the_keys():
  with pytest.raises(ConfigError, match="rl.inflight_updates"):   # the sync loop
    trainer_lib.RLJob.from_config(_config(**{"sampler.engine": "continuous", "rl.inflight_updates": True}))
  with pytest.raises(ConfigError, match="rl.inflight_updates"):   # K = 0 is the sync loop
    trainer_lib.RLJob.from_config(_config(**ASYNC, **{"rl.inflight_updates": True, "rl.max_staleness": 0}))
  with pytest.raises(ConfigError, match="rl.inflight_updates"):
    trainer_lib.RLJob.from_config(_config(**ASYNC, **{"rl.inflight_updates": True, "rl.stale_policy": "drop",
                                                      "rl.sampler_sync_every": 2}))
  with pytest.raises(ConfigError, match="sampler.engine"):
    trainer_lib.RLJob.from_config(_config(**{**ASYNC, "sampler.engine": "static", "rl.inflight_updates": True}))
  with pytest.raises(ConfigError, match="rl.inflight_chunk"):
    trainer_lib.RLJob.from_config(_config(**ASYNC, **{"rl.inflight_updates": True, "rl.inflight_chunk": 0}))
  with pytest.raises(ConfigError, match="rl.inflight_resume"):   # not a form
    trainer_lib.RLJob.from_config(_config(**ASYNC, **{"rl.inflight_updates": True, "rl.inflight_resume": "cache"}))
  with pytest.raises(ConfigError, match="rl.inflight_resume"):   # no rollouts in generation to checkpoint
    trainer_lib.RLJob.from_config(_config(**ASYNC, **{"rl.inflight_resume": "carry"}))
  job = trainer_lib.RLJob.from_config(_config(**ASYNC, **{"rl.inflight_updates": True, "rl.inflight_chunk": 4}))
  assert (job.rl.inflight_updates, job.rl.inflight_chunk, job.rl.inflight_resume) == (True, 4, "reprefill")


RUN = {**ASYNC, "rl.max_staleness": 2, "rl.steps": 4, "rl.eval_every": 4, "rl.checkpoint_every": 10,
       "rl.inflight_chunk": 3}
# Rows that differ between two runs by design: wall times, busy fractions, the in-flight metrics.
VOLATILE = ("time/", "async/sampler_busy", "async/trainer_busy", "async/busy_overlap", "async/token_lag",
            "async/waits")


def _rows(workdir):
  return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in read_metrics(str(workdir))
          if "reward" in r]


def _params(workdir, cfg):
  with trainer_lib.RLTrainer(sweeps.apply_overrides(cfg, {"resume": "force"}), str(workdir)) as tr:
    return tr.start_step, jax.tree.map(np.asarray, tr.state["params"])


def _equal(a, b):
  return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _frozen_sampler(monkeypatch):
  """The sampler keeps the weights of its first sync for the whole run (the trainer still learns)."""
  real = trainer_lib.RLTrainer.sync_sampler

  def sync_once(self):
    if not hasattr(self, "_frozen"):
      real(self)
      self._frozen = self.sampler_state
    self.sampler_state = self._frozen
  monkeypatch.setattr(trainer_lib.RLTrainer, "sync_sampler", sync_once)


@pytest.mark.slow  # two 4-step async runs
def test_unchanging_sampler_weights_equal_the_run_without_inflight_updates(tmp_path, monkeypatch):
  """The sampler's weights never change (its first sync kept): in-flight updates give the run
  without them bit for bit, every metric of every step (rewards from the same tokens, the p_old
  forward and update metrics from the same log q) and the same trained params."""
  _frozen_sampler(monkeypatch)
  cfg = {**RUN, "rl.p_old_version": "rollout"}
  trainer_lib.run(_config(**cfg), str(tmp_path / "plain"))
  trainer_lib.run(_config(**cfg, **{"rl.inflight_updates": True}), str(tmp_path / "inflight"))
  a, b = _rows(tmp_path / "plain"), _rows(tmp_path / "inflight")
  assert len(a) == 4 and a == b
  assert _equal(_params(tmp_path / "plain", _config(**cfg))[1],
                _params(tmp_path / "inflight", _config(**cfg, **{"rl.inflight_updates": True}))[1])


@pytest.fixture(scope="module")  # a 4-step async run (the tests that use it are slow)
def inflight_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("inflight")
  trainer_lib.run(_config(**RUN, **{"rl.inflight_updates": True}), str(workdir))
  return workdir


# `rl.inflight_resume`, and what a resumed run can equal: 'carry' continues each rollout in generation
# from its whole engine carry, so the run is the uninterrupted one whatever the weights; 'reprefill'
# rebuilds the KV caches with the resumed step's weights, which wrote the uninterrupted run's cache
# only where the weights never change (here an lr too small to move any parameter: the params stay
# bit for bit), and give its very bits in the batch-invariant mode (where prefill and decode compute
# K and V alike; else they differ in float rounding, docs/architecture.md#in-flight-weight-updates).
# The batch-invariant mode's RMSNorm is an ordered sum for this (rl_jax/models/layers.py): XLA:CPU's
# reduce rounded a token's norm by the shape of the forward around it, so the first slots' batched
# prefill and a re-prefill chunk wrote keys and values up to 9.5e-7 apart (layer 0, this model).
RESUME = {"carry": {"rl.inflight_resume": "carry"},
          "reprefill": {"rl.inflight_resume": "reprefill", "optim.lr": 1e-30, "model.batch_invariant": True}}


@pytest.fixture(scope="module")  # the uninterrupted 4-step run of the 'reprefill' resume tests
def frozen_inflight_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("inflight_frozen")
  trainer_lib.run(_config(**RUN, **{"rl.inflight_updates": True}, **RESUME["reprefill"]), str(workdir))
  return workdir


def _saved_shapes(workdir, step: int) -> dict:
  """Path -> shape of every array of checkpoint `step`'s in-flight item."""
  md = ocp.StandardCheckpointer().metadata(str(workdir / "checkpoints" / str(step) / "inflight")).item_metadata
  return {jax.tree_util.keystr(p): tuple(x.shape) for p, x in jax.tree_util.tree_leaves_with_path(md.tree)}


def _cache_shapes(cfg) -> set:
  """The shapes of the sampler's KV cache arrays of `cfg` (every row in a slot)."""
  job = trainer_lib.RLJob.from_config(cfg)
  rows = job.rl.prompts_per_step * job.rl.group_size
  return {x.shape for x in jax.tree.leaves(jax.eval_shape(lambda: init_cache(job.model, rows, job.sampler.max_len)))}


@pytest.mark.slow
def test_token_lags_of_an_inflight_run(inflight_run):
  """K = 2: a rollout spans up to 3 versions; its tokens lag 0..2, the oldest lag is `async/lag`."""
  rows = [r for r in read_metrics(str(inflight_run)) if "reward" in r]
  assert [r["async/lag"] for r in rows] == [0.0, 1.0, 2.0, 2.0]
  for r in rows:
    shares = [r[f"async/token_lag_share/{l}"] for l in range(3)]
    np.testing.assert_allclose(sum(shares), 1.0, rtol=1e-9)
    assert 0 <= r["async/token_lag_mean"] <= r["async/token_lag_max"] <= r["async/lag"], r
  assert rows[0]["async/token_lag_max"] == 0.0   # step 0: version 0 throughout
  # Steps 2, 3 began at lag 2 and ran at least one chunk per version: every lag occurs.
  for r in rows[2:]:
    assert r["async/token_lag_max"] == 2.0 and r["async/token_lag_share/0"] > 0, r
  summary = json.loads((inflight_run / "summary.json").read_text())
  w = np.asarray([r["response_length"] for r in rows]) / sum(r["response_length"] for r in rows)
  np.testing.assert_allclose(summary["token_lag_mean"], sum(w * [r["async/token_lag_mean"] for r in rows]))
  np.testing.assert_allclose(sum(summary["token_lag_share"].values()), 1.0, rtol=1e-9)


@pytest.mark.slow  # an interrupted and a resumed 4-step run ('reprefill': and its own uninterrupted run)
@pytest.mark.parametrize("mode", ["carry", "reprefill"])
def test_sigterm_with_rollouts_in_generation_resumes_to_the_uninterrupted_run(tmp_path, mode, request, monkeypatch):
  """SIGTERM while step 1 trains: step 2 is saved with the rollouts of steps 2 and 3 still in
  generation ('carry': their engine carries, KV cache included; 'reprefill': their progress, no array
  of the KV cache's shapes); the resumed run ends on the uninterrupted run's params and metrics bit
  for bit (`RESUME`: 'reprefill' with weights that never change, in the batch-invariant mode)."""
  cfg = _config(**RUN, **{"rl.inflight_updates": True}, **RESUME[mode])
  uninterrupted = request.getfixturevalue("inflight_run" if mode == "carry" else "frozen_inflight_run")
  workdir = tmp_path / "preempted"
  real = trainer_lib.RLTrainer.train_on

  def signal_during_step_1(self, item, t0, t1):
    if item.step == 1:
      os.kill(os.getpid(), signal.SIGTERM)
    return real(self, item, t0, t1)
  with monkeypatch.context() as m:
    m.setattr(trainer_lib.RLTrainer, "train_on", signal_during_step_1)
    with pytest.raises(preempt.Preempted):
      trainer_lib.run(cfg, str(workdir))
  ckpt = Checkpointer(str(workdir), create=False)
  meta = ckpt.manager.restore(2, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
  ckpt.close()
  assert meta["inflight_steps"] == [2, 3] and meta["inflight_versions"] == [0, 1]
  assert meta["inflight_advanced"] == [1, 1] and meta["inflight_resume"] == mode
  saved = _saved_shapes(workdir, 2)
  assert any("['cache']" in p for p in saved) == (mode == "carry")
  assert bool(_cache_shapes(cfg) & set(saved.values())) == (mode == "carry")
  trainer_lib.run(cfg, str(workdir))
  assert _rows(workdir) == _rows(uninterrupted)
  final = _params(workdir, cfg)[1]
  assert _equal(_params(uninterrupted, cfg)[1], final)
  if mode == "reprefill":  # the weights never changed
    job = trainer_lib.RLJob.from_config(cfg)
    assert _equal(jax.tree.map(np.asarray, train_state.init_params(job.model, job.seed, sh.split_meshes(job.mesh)[0])[1]), final)


@pytest.mark.slow  # three 5-step runs in subprocesses
@pytest.mark.parametrize("mode", ["carry", "reprefill"])
def test_kill9_with_rollouts_in_generation_resumes_to_the_uninterrupted_run(tmp_path, mode):
  """`python -m rl_jax.main` with in-flight updates (K = 2, chunks of 3 iterations) killed with
  SIGKILL after step 2's checkpoint (inside a later step's chunks): the rerun restores the rollouts
  in generation with step 2 and ends on the uninterrupted run's metrics, every step bit for bit
  (`RESUME`: 'reprefill' with weights that never change, in the batch-invariant mode)."""
  def cmd(workdir):
    return ["-m", "rl_jax.main", "--config=configs/countdown_tiny.py:test", f"--workdir={workdir}",
            "--config.warm_start.source=none", "--config.rl.steps=5", "--config.rl.eval_every=5",
            "--config.rl.mode=async", "--config.rl.max_staleness=2", "--config.sampler.engine=continuous",
            "--config.rl.inflight_updates=True", "--config.rl.inflight_chunk=3",
            *[f"--config.{k}={v}" for k, v in RESUME[mode].items()]]
  clean, killed = tmp_path / "clean", tmp_path / "killed"
  run_clean_and_killed(cmd, clean, killed, kill_after=2, last=5)
  assert len(_rows(clean)) == 5 and _rows(killed) == _rows(clean)
