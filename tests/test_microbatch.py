"""Micro-batching: strided splits stay on their devices; accumulated == one-shot update, p_old and meter."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax import microbatch
from rl_jax import sharding as sh
from rl_jax import train_state
from rl_jax.config_utils import ConfigError
from rl_jax.models import ModelConfig
from rl_jax.optim import OptimConfig, make_optimizer
from rl_jax.rl import step as step_lib
from rl_jax.rl.loss.loss_config import LossConfig

pytestmark = pytest.mark.usefixtures("fast_compile")

P, T, V, B = 3, 5, 32, 8
MOE = ModelConfig(vocab_size=V, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=8, d_ff=32,
                  n_experts=4, n_experts_per_tok=2, moe_d_ff=16, init_std=0.5, tie_embeddings=False,
                  router_aux_loss_coef=0.01)
# float32 sums taken in another order: the micro-batches add B / n rows' terms, then n partial
# sums. Each result is a sum of O(B T) terms of the size of the largest, so reordering moves it by
# at most ~ B T eps_f32 of that scale; 64 eps (7.6e-6) covers B T = 40 with margin.
RTOL = 64 * float(np.finfo(np.float32).eps)


def _batch(seed=0):
  rng = np.random.default_rng(seed)
  lengths = np.asarray([5, 3, 1, 4, 0, 2, 5, 5])   # one empty response: seq_mean's B still counts it
  tokens = rng.integers(0, V, size=(B, P + T)).astype(np.int32)
  resp_mask = np.arange(T)[None] < lengths[:, None]
  valid = np.concatenate([np.ones((B, P), bool), resp_mask], axis=1)
  pos = np.broadcast_to(np.arange(P + T, dtype=np.int32), tokens.shape)
  topk_logq = np.sort(np.log(rng.dirichlet(np.ones(V), (B, T))), -1)[..., ::-1][..., :4]
  logq = -2.0 - rng.exponential(size=(B, T))
  return step_lib.TrainBatch(
      prompt_len=P, tokens_BS=jnp.asarray(tokens), positions_BS=jnp.asarray(pos),
      valid_BS=jnp.asarray(valid), response_BT=jnp.asarray(tokens[:, P:]),
      response_mask_BT=jnp.asarray(resp_mask), logq_BT=jnp.asarray(logq, jnp.float32),
      adv_B=jnp.asarray(rng.normal(size=B), jnp.float32),
      logp_old_BT=jnp.asarray(logq + rng.normal(0, 0.1, (B, T)), jnp.float32),
      topk_ids_BTK=jnp.asarray(rng.integers(0, V, (B, T, 4)), jnp.int32),
      topk_logq_BTK=jnp.asarray(topk_logq, jnp.float32))


def test_split_is_strided_and_merge_inverts_it():
  x = jnp.arange(12 * 3).reshape(12, 3)
  parts = microbatch.split({"x": x}, 4)["x"]
  assert parts.shape == (4, 3, 3)
  np.testing.assert_array_equal(parts[1], x[1::4])
  np.testing.assert_array_equal(microbatch.merge(parts), x)
  assert microbatch.count(16, 0, "k") == 1 and microbatch.count(16, 16, "k") == 1
  assert microbatch.count(16, 4, "k", divisor=4) == 4
  with pytest.raises(ConfigError, match="'rl.update_microbatch': 5 rows per micro-batch do not divide"):
    microbatch.count(16, 5, "rl.update_microbatch")
  with pytest.raises(ConfigError, match="do not split over the mesh's batch axes"):
    microbatch.count(16, 4, "rl.update_microbatch", divisor=8)


def test_split_of_a_batch_sharded_array_moves_nothing():
  """Every micro-batch of a batch spread over 8 devices is itself spread over the 8: the split is
  a local reshape (no collective in the compiled program)."""
  mesh = sh.make_mesh(sh.MeshConfig(data=1, fsdp=-1), jax.devices()[:8])
  x = jax.device_put(jnp.arange(64.0).reshape(32, 2), sh.batch_sharding(mesh, 2))
  fn = jax.jit(lambda x: microbatch.split(x, 4)[2] * 2.0)
  hlo = fn.lower(x).compile().as_text()
  assert not any(op in hlo for op in ("all-gather", "all-to-all", "collective-permute", "all-reduce"))
  out = fn(x)
  np.testing.assert_array_equal(out, np.asarray(x)[2::4] * 2.0)


def test_rl_minibatches_keep_their_rows_sharded_and_compile_once():
  """`LearnerPrograms.minibatches` (rl.n_minibatches = 2 on a 4-device batch mesh): each mini-batch is
  its rows of the batch, split over the batch axes (not replicated), and a second step's slices reuse
  the first step's programs (a fresh jit per call would compile them again every step)."""
  from types import SimpleNamespace  # pylint: disable=g-import-not-at-top
  from rl_jax.rl import programs as programs_lib  # pylint: disable=g-import-not-at-top
  mesh = sh.make_mesh(sh.MeshConfig(data=1, fsdp=-1), jax.devices()[:4])
  batch = jax.device_put(_batch(), sh.batch_sharding(mesh, 1))
  owner = SimpleNamespace(n_minibatches=2, mesh=mesh)
  for _ in range(2):
    mbs = list(programs_lib.LearnerPrograms.minibatches(owner, batch))
    for i, mb in enumerate(mbs):
      np.testing.assert_array_equal(mb.tokens_BS, np.asarray(batch.tokens_BS)[4 * i:4 * (i + 1)])
      assert mb.tokens_BS.sharding.is_equivalent_to(sh.batch_sharding(mesh, 2), 2)
      assert mb.tokens_BS.sharding.shard_shape(mb.tokens_BS.shape)[0] == 1
  assert [programs_lib._minibatch(mesh, 4 * i, 4 * (i + 1))._cache_size() for i in range(2)] == [1, 1]


def _close(a, b, what):
  """Equal to float32 reordering (RTOL) relative to the array's own scale."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  scale = max(np.max(np.abs(b)), 1e-30)
  np.testing.assert_allclose(a / scale, b / scale, rtol=0, atol=RTOL, err_msg=what)


CASES = {
    "pg_batch_tokens": LossConfig(method="pg", aggregation="batch_tokens"),
    "sc_tis_constant": LossConfig(method="tis", score_centering="topk", topk=4, aggregation="constant"),
    "minirl_seq_mean": LossConfig(method="minirl", aggregation="seq_mean"),
    "gspo_batch_tokens": LossConfig(method="gspo"),
    "dppo_seq_mean": LossConfig(method="dppo", aggregation="seq_mean"),
}


# Replay changes the routing, not the loss: R3 with two of the rules (a top-k SC one and a
# masking one) covers it without doubling the grid.
@pytest.mark.parametrize("case,replay", [(c, "none") for c in sorted(CASES)]
                         + [("sc_tis_constant", "R3"), ("minirl_seq_mean", "R3")])
def test_accumulated_update_equals_one_shot(case, replay):
  loss_cfg = CASES[case]
  graphdef, params = train_state.init_params(MOE, 0)
  batch = _batch()
  if replay == "R3":
    rng = np.random.default_rng(1)
    batch = batch.replace(replay_ids_BSLK=jnp.asarray(np.argsort(rng.random((B, P + T, 2, 4)), -1)[..., :2],
                                                      jnp.int32),
                          replay_mask_BS=batch.valid_BS)
  # SGD at lr 1: new params = params - grads, so comparing params compares the gradients.
  opt = make_optimizer(OptimConfig(name="sgd", lr=1.0))
  kw = dict(graphdef=graphdef, optimizer=opt, loss_cfg=loss_cfg, aux_coef=0.0)
  one = jax.jit(functools.partial(step_lib.update, **kw))
  acc = jax.jit(functools.partial(step_lib.update, **kw, microbatches=4))
  p1, _, m1 = one(params, opt.init(params), batch)
  p4, _, m4 = acc(params, opt.init(params), batch)
  assert bool(m1["finite"]) and bool(m4["finite"])
  for (path, a), b, p0 in zip(jax.tree_util.tree_leaves_with_path(p4), jax.tree.leaves(p1),
                              jax.tree.leaves(params)):
    _close(np.asarray(a) - np.asarray(p0), np.asarray(b) - np.asarray(p0), jax.tree_util.keystr(path))
  assert m4.keys() == m1.keys()
  for k in m1:
    # aux_loss is per micro-batch by design (next test); aux_coef = 0 keeps it out of the gradient.
    if k not in ("finite", "aux_loss"):
      _close(m4[k], m1[k], k)


def test_aux_loss_is_the_token_weighted_mean_of_the_micro_batches():
  """With aux_coef > 0 the load-balancing term is per micro-batch (it does not split over rows):
  the accumulated update's aux_loss is the valid-token-weighted mean of the micro-batches'."""
  loss_cfg = LossConfig()
  graphdef, params = train_state.init_params(MOE, 0)
  batch = _batch()
  opt = make_optimizer(OptimConfig(name="sgd", lr=1.0))
  _, _, m = jax.jit(functools.partial(step_lib.update, graphdef=graphdef, optimizer=opt, loss_cfg=loss_cfg,
                                      aux_coef=0.01, microbatches=2))(params, opt.init(params), batch)
  want, total = 0.0, float(jnp.sum(batch.valid_BS))

  @jax.jit  # one program for both micro-batches: eagerly every op compiles its own XLA program
  def micro(params, batch, i):
    mb = jax.tree.map(lambda x: x[i], microbatch.split(batch, 2))
    _, mm = step_lib.loss_fn(params, mb, graphdef=graphdef, loss_cfg=loss_cfg, aux_coef=0.01)
    return jnp.sum(mb.valid_BS), mm["aux_loss"]
  for i in range(2):
    n_valid, aux = micro(params, batch, i)
    want += float(n_valid) / total * float(aux)
  np.testing.assert_allclose(m["aux_loss"], want, rtol=RTOL)


@pytest.mark.parametrize("replay", ["none", "R3"])
def test_microbatched_p_old_forward_and_meter_equal_one_shot(replay):
  loss_cfg = CASES["sc_tis_constant"]
  graphdef, params = train_state.init_params(MOE, 0)
  batch = _batch().replace(logp_old_BT=None)
  rng = np.random.default_rng(2)
  ids = jnp.asarray(np.argsort(rng.random((B, P + T, 2, 4)), -1)[..., :2], jnp.int32)
  kw = dict(graphdef=graphdef, loss_cfg=loss_cfg, replay=replay)
  a = jax.jit(functools.partial(step_lib.old_forward, **kw))(params, batch, ids, batch.valid_BS)
  b = jax.jit(functools.partial(step_lib.old_forward, **kw, microbatches=4))(params, batch, ids, batch.valid_BS)
  _close(b[0], a[0], "logp_old")
  np.testing.assert_array_equal(b[1], a[1])
  assert a[2].keys() == b[2].keys() and "mismatch/routing_agreement" in a[2]
  for k in a[2]:
    _close(b[2][k], a[2][k], k)
  batch = batch.replace(logp_old_BT=a[0])
  fo1 = step_lib.first_order_jit(params, batch, graphdef=graphdef, loss_cfg=loss_cfg)
  fo4 = step_lib.first_order_jit(params, batch, graphdef=graphdef, loss_cfg=loss_cfg, microbatches=4)
  for k in fo1:
    _close(fo4[k], fo1[k], k)
