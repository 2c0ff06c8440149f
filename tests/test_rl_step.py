"""The RL step functions: the response-slot head equals the full forward's logits, donation aliases every buffer."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rl_jax import train_state
from rl_jax.models import ModelConfig
from rl_jax.optim import OptimConfig, make_optimizer
from rl_jax.rl import step as step_lib
from rl_jax.rl.loss.loss_config import LossConfig
from rl_jax.rl.loss.losses import rl_loss

pytestmark = pytest.mark.usefixtures("fast_compile")

P, T, V = 3, 5, 32
CFGS = {
    "dense_tied": ModelConfig(vocab_size=V, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8,
                              d_ff=32, init_std=0.5),
    "moe_untied": ModelConfig(vocab_size=V, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=8,
                              d_ff=32, n_experts=4, n_experts_per_tok=2, moe_d_ff=16, init_std=0.5,
                              tie_embeddings=False, router_aux_loss_coef=0.01),
}


def _batch(seed=0, lengths=(5, 3, 1, 4)):
  rng = np.random.default_rng(seed)
  b = len(lengths)
  tokens = rng.integers(0, V, size=(b, P + T)).astype(np.int32)
  resp_mask = np.arange(T)[None] < np.asarray(lengths)[:, None]
  valid = np.concatenate([np.ones((b, P), bool), resp_mask], axis=1)
  pos = np.broadcast_to(np.arange(P + T, dtype=np.int32), tokens.shape)
  topk_logq = np.sort(np.log(rng.dirichlet(np.ones(V), (b, T))), -1)[..., ::-1][..., :4]
  return step_lib.TrainBatch(
      prompt_len=P, tokens_BS=jnp.asarray(tokens), positions_BS=jnp.asarray(pos),
      valid_BS=jnp.asarray(valid), response_BT=jnp.asarray(tokens[:, P:]),
      response_mask_BT=jnp.asarray(resp_mask),
      logq_BT=jnp.asarray(-2.0 - rng.exponential(size=(b, T)), jnp.float32),
      adv_B=jnp.asarray([1.0, -0.6, 0.3, -0.7][:b], jnp.float32),
      topk_ids_BTK=jnp.asarray(rng.integers(0, V, (b, T, 4)), jnp.int32),
      topk_logq_BTK=jnp.asarray(topk_logq, jnp.float32))


def _full_logits_loss(params, batch, graphdef, loss_cfg, aux_coef):
  """The loss as computed before the head moved to the response slots: every slot's logits, sliced."""
  model = nnx.merge(graphdef, params)
  out = model(batch.tokens_BS, batch.positions_BS, batch.valid_BS)
  loss, m = rl_loss(batch.response_slots(out.logits_BSV), batch.response_BT, batch.response_mask_BT,
                    batch.adv_B, batch.logq_BT, loss_cfg, logp_old_BT=batch.logp_old_BT,
                    topk_ids_BTK=batch.topk_ids_BTK, topk_logq_BTK=batch.topk_logq_BTK)
  return loss + aux_coef * out.aux_loss, m


@pytest.mark.parametrize("name", sorted(CFGS))
def test_response_slot_head_equals_the_full_forward(name):
  cfg = CFGS[name]
  graphdef, params = train_state.init_params(cfg, 0)
  loss_cfg = LossConfig(method="tis", score_centering="topk", topk=4)
  batch = _batch()
  # p_old: the full forward's log-softmax at the sampled tokens, response slots.
  model = nnx.merge(graphdef, params)
  logits_BSV = model(batch.tokens_BS, batch.positions_BS, batch.valid_BS).logits_BSV
  logp_BSV = jax.nn.log_softmax(np.asarray(logits_BSV, np.float64), axis=-1)
  want = np.take_along_axis(np.asarray(batch.response_slots(logp_BSV)),
                            np.asarray(batch.response_BT)[..., None], -1)[..., 0]
  got, _, _ = step_lib.old_forward(params, batch, graphdef=graphdef, loss_cfg=loss_cfg)
  np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)
  batch = batch.replace(logp_old_BT=got)
  # The loss and every gradient, against the sliced-full-logits reference.
  kw = dict(graphdef=graphdef, loss_cfg=loss_cfg, aux_coef=cfg.router_aux_loss_coef)
  (l_new, m_new), g_new = jax.value_and_grad(functools.partial(step_lib.loss_fn, **kw), has_aux=True)(
      params, batch)
  (l_ref, m_ref), g_ref = jax.value_and_grad(functools.partial(_full_logits_loss, **kw), has_aux=True)(
      params, batch)
  np.testing.assert_allclose(l_new, l_ref, rtol=1e-6)
  for k in m_ref:
    np.testing.assert_allclose(m_new[k], m_ref[k], rtol=1e-5, atol=1e-6, err_msg=k)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_new), jax.tree.leaves(g_ref)):
    scale = max(float(jnp.max(jnp.abs(b))), 1e-30)
    np.testing.assert_allclose(np.asarray(a) / scale, np.asarray(b) / scale, rtol=0, atol=1e-5,
                               err_msg=jax.tree_util.keystr(path))


def test_update_donates_every_param_and_optimizer_buffer():
  """The trainer's jitted update (donate_argnums=(0, 1)) writes params and AdamW state in place:
  the compiled program aliases one output to each donated input leaf, so no step copies them."""
  cfg = CFGS["moe_untied"]
  graphdef, params = train_state.init_params(cfg, 0)
  optimizer = make_optimizer(OptimConfig(name="adamw", lr=1e-3, grad_clip=1.0))
  opt_state = optimizer.init(params)
  batch = _batch()
  batch = batch.replace(logp_old_BT=batch.logq_BT)
  update = jax.jit(functools.partial(step_lib.update, graphdef=graphdef, optimizer=optimizer,
                                     loss_cfg=LossConfig(), aux_coef=0.01), donate_argnums=(0, 1))
  hlo = update.lower(params, opt_state, batch).compile().as_text()
  n_donated = len(jax.tree.leaves(params)) + len(jax.tree.leaves(opt_state))
  head = hlo[hlo.index("input_output_alias="):].split("\n", 1)[0]
  assert head.count("may-alias") + head.count("must-alias") == n_donated


@pytest.mark.parametrize("replay,microbatches", [("none", 1), ("R2", 1), ("R3", 2)])
def test_p_old_in_the_update_equals_the_separate_p_old_forward(replay, microbatches):
  """`TrainBatch.old_in_update` (the trainer's choice for p_old 'latest' and one mini-batch): the
  update takes log p_old from its own forward and reports the mismatch metrics, with the same
  gradient, loss metrics and `mismatch/*` as the separate p_old forward's batch (R2 replaying that
  forward's own experts, R3 the sampler's; gradient accumulation over 2 micro-batches for R3)."""
  cfg = CFGS["moe_untied"]
  graphdef, params = train_state.init_params(cfg, 0)
  loss_cfg = LossConfig(method="ppo")  # reads p_old: its clip acts on p / p_old
  batch = _batch()
  rng = np.random.default_rng(3)
  n_moe = cfg.n_layers  # every layer of this config is MoE
  ids_BSLK = jnp.asarray(rng.integers(0, cfg.n_experts, (batch.rows, P + T, n_moe, cfg.n_experts_per_tok)),
                         jnp.uint8)
  logp_old, own_ids, m_old = step_lib.old_forward(params, batch, ids_BSLK, batch.valid_BS, graphdef=graphdef,
                                                  loss_cfg=loss_cfg, replay=replay)
  routes = {"none": None, "R2": own_ids, "R3": ids_BSLK}[replay]
  ref = batch.replace(logp_old_BT=logp_old, replay_ids_BSLK=routes,
                      replay_mask_BS=None if routes is None else batch.valid_BS)
  new = batch.replace(old_in_update=True, sampler_ids_BSLK=ids_BSLK, sampler_valid_BS=batch.valid_BS,
                      **({"replay_ids_BSLK": ids_BSLK, "replay_mask_BS": batch.valid_BS} if replay == "R3" else {}))
  sgd = make_optimizer(OptimConfig(name="sgd", lr=1.0))
  update = jax.jit(functools.partial(step_lib.update, graphdef=graphdef, optimizer=sgd, loss_cfg=loss_cfg,
                                     aux_coef=0.01, microbatches=microbatches))
  p_ref, _, m_ref = update(params, sgd.init(params), ref)
  p_new, _, m_new = update(params, sgd.init(params), new)
  assert set(m_new) == set(m_ref) | set(m_old)
  for k in m_ref:
    np.testing.assert_allclose(m_new[k], m_ref[k], rtol=1e-5, atol=1e-6, err_msg=k)
  for k in m_old:
    np.testing.assert_allclose(m_new[k], m_old[k], rtol=1e-5, atol=1e-7, err_msg=k)
  assert float(m_new["mismatch/routing_agreement"]) < 1.0  # the random sampler routes disagree
  # SGD at lr 1: params - new params = the gradient.
  for (path, a), b, p in zip(jax.tree_util.tree_leaves_with_path(p_new), jax.tree.leaves(p_ref),
                             jax.tree.leaves(params)):
    g_new, g_ref = np.asarray(p) - np.asarray(a), np.asarray(p) - np.asarray(b)
    scale = max(float(np.max(np.abs(g_ref))), 1e-30)
    np.testing.assert_allclose(g_new / scale, g_ref / scale, rtol=0, atol=1e-5, err_msg=jax.tree_util.keystr(path))
  if replay == "R3":  # the first-order meter reads the same batch before the update
    meter = jax.jit(functools.partial(step_lib.first_order, graphdef=graphdef, loss_cfg=loss_cfg,
                                      microbatches=microbatches))
    fo_ref, fo_new = meter(params, ref), meter(params, new)
    for k in fo_ref:
      np.testing.assert_allclose(fo_new[k], fo_ref[k], rtol=1e-5, err_msg=k)
