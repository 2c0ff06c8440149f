"""Pure RL step functions over a typed TrainBatch: the theta_old forward, the loss and one update.

Module-level so a notebook can import and jit them: every config argument is keyword-only and
hashable (`jax.jit(step.loss_fn, static_argnames=STATIC)`), the arrays are positional.
"""
from __future__ import annotations

from typing import Any, Literal

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from rl_jax import rollout as rollout_lib
from rl_jax.logprobs import chunked_logprobs, gather_logprobs
from rl_jax.models.transformer import constrain_batch
from rl_jax.rl import meters
from rl_jax.rl.loss_config import LossConfig
from rl_jax.rl.losses import rl_loss, rl_loss_from_hidden

Replay = Literal["none", "R2", "R3"]
# Keyword arguments of the step functions that are configuration (static under jit).
STATIC = ("graphdef", "loss_cfg", "aux_coef", "optimizer", "replay")


@flax.struct.dataclass
class TrainBatch:
  """What one global step trains on, rows = responses (B), laid out as `rl_jax.rollout.Rollout`.

  `logp_old_BT` is filled by `old_forward`; `replay_*` only under routing replay (R2: the
  trainer's own theta_old experts, R3: the sampler's); top-k fields whenever the sampler
  recorded them (`sampler.record_topk` > 0): score centering reads them and the drift meter
  (`drift/*`) compares them with the trainer's distribution. Optional fields are None when
  absent (empty pytree nodes).
  """
  prompt_len: int = flax.struct.field(pytree_node=False)
  tokens_BS: jax.Array
  positions_BS: jax.Array
  valid_BS: jax.Array
  response_BT: jax.Array
  response_mask_BT: jax.Array
  logq_BT: jax.Array
  adv_B: jax.Array
  logp_old_BT: jax.Array | None = None
  topk_ids_BTK: jax.Array | None = None
  topk_logq_BTK: jax.Array | None = None
  replay_ids_BSLK: jax.Array | None = None
  replay_mask_BS: jax.Array | None = None

  @classmethod
  def from_rollout(cls, ro: rollout_lib.Rollout, adv_B: jax.Array, with_topk: bool = True) -> "TrainBatch":
    topk = with_topk and ro.topk_ids_BTK is not None
    return cls(prompt_len=ro.prompt_len, tokens_BS=ro.tokens_BS, positions_BS=ro.positions_BS,
               valid_BS=ro.valid_BS, response_BT=ro.response_BT, response_mask_BT=ro.response_mask_BT,
               logq_BT=ro.logq_BT, adv_B=adv_B,
               topk_ids_BTK=ro.topk_ids_BTK if topk else None,
               topk_logq_BTK=ro.topk_logq_BTK if topk else None)

  @property
  def rows(self) -> int:
    return self.tokens_BS.shape[0]

  def slice_rows(self, start: int, stop: int) -> "TrainBatch":
    return jax.tree.map(lambda x: x[start:stop], self)

  def response_slots(self, x_BS: jax.Array) -> jax.Array:
    """The logits-aligned response slots of a forward over `tokens_BS` (see `rollout.response_slice`)."""
    return rollout_lib.response_slots(x_BS, self.prompt_len, self.logq_BT.shape[1])


def masked_mean(x, mask):
  mask = mask.astype(jnp.float32)
  return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def routing_agreement(trainer_ids_BSLK, sampler_ids_BSLK, valid_BS):
  """Fraction of (token, MoE layer, slot) where the sampler's expert is among the trainer's top-k."""
  hit = jnp.any(sampler_ids_BSLK[..., :, None] == trainer_ids_BSLK[..., None, :], axis=-1)
  mask = jnp.broadcast_to(valid_BS[:, :, None, None], hit.shape)
  return masked_mean(hit.astype(jnp.float32), mask)


def _forward(model, batch: TrainBatch, **kw):
  # Hidden states only: the head runs at the T response slots alone (`_response_logits`),
  # not at all S positions. Slicing [B, S, V] logits instead costs the prompt slots' share
  # of the unembedding matmuls and, in the backward, a padded [B, S, V] cotangent.
  return model(batch.tokens_BS, batch.positions_BS, batch.valid_BS, return_hidden=True,
               compute_logits=False, **kw)


def _response_logits(model, out, batch: TrainBatch) -> jax.Array:
  """Float32 logits [B, T, V] at the response slots (unchunked losses)."""
  return model.logits(batch.response_slots(out.hidden_BSD))


def _replay_kw(batch: TrainBatch) -> dict:
  """Routing replay is on iff `batch.replay_ids_BSLK` is set."""
  if batch.replay_ids_BSLK is None:
    return {}
  return dict(replay_ids_BSLK=batch.replay_ids_BSLK, replay_mask_BS=batch.replay_mask_BS)


def _sampled_logp(model, out, batch: TrainBatch, loss_cfg: LossConfig) -> jax.Array:
  """log p of the sampled tokens [B, T] from a forward's output, with the function the loss uses."""
  targets_BT1 = batch.response_BT[..., None]
  temp = loss_cfg.temperature
  if loss_cfg.chunk_size > 0:
    hidden_BTD = batch.response_slots(out.hidden_BSD)
    return chunked_logprobs(hidden_BTD, model.unembed_weight(), targets_BT1, temp,
                            loss_cfg.chunk_size)[0][..., 0]
  # The function the loss computes log p with (chunked or not): p_old and p agree in form.
  return gather_logprobs(_response_logits(model, out, batch), targets_BT1, temp)[0][..., 0]


def _rl_loss(model, out, batch: TrainBatch, loss_cfg: LossConfig):
  """The RL loss (no load-balancing term) of a forward's output and its metrics."""
  args = (batch.response_BT, batch.response_mask_BT, batch.adv_B, batch.logq_BT, loss_cfg)
  opt = dict(logp_old_BT=batch.logp_old_BT, topk_ids_BTK=batch.topk_ids_BTK,
             topk_logq_BTK=batch.topk_logq_BTK)
  if loss_cfg.chunk_size > 0:
    return rl_loss_from_hidden(batch.response_slots(out.hidden_BSD), model.unembed_weight(), *args, **opt)
  return rl_loss(_response_logits(model, out, batch), *args, **opt)


def old_forward(params, batch: TrainBatch, sampler_ids_BSLK=None, sampler_valid_BS=None, *,
                graphdef: nnx.GraphDef, loss_cfg: LossConfig, replay: Replay = "none"):
  """theta_old's log-probs of the sampled tokens, its own routing and the mismatch metrics.

  p_old is computed under the same routing as the updates will use, so that at theta =
  theta_old every staleness ratio pi_theta / pi_theta_old is exactly 1: 'none' and R2 on the
  trainer's own routing, R3 replaying the sampler's experts (`sampler_ids_BSLK` where
  `sampler_valid_BS`). The `mismatch/*` metrics compare the sampler's q with this p_old.

  Returns (logp_old_BT, own_ids_BSLK or None, metrics): `own_ids_BSLK` are the experts the
  trainer itself routes to (R2 replays them).
  """
  model = nnx.merge(graphdef, params)
  r3 = replay == "R3"
  if r3 and sampler_ids_BSLK is None:
    raise ValueError("routing_replay='R3' needs the sampler's expert ids (sampler.record_experts)")
  kw = {}
  if r3:
    kw = dict(replay_ids_BSLK=sampler_ids_BSLK, replay_mask_BS=sampler_valid_BS, return_router_logits=True)
  out = _forward(model, batch, **kw)
  logp_old_BT = _sampled_logp(model, out, batch, loss_cfg)
  own_ids_BSLK = out.expert_ids_BSLK
  if r3 and own_ids_BSLK is not None:
    # Under replay the model reports the replayed ids, but the agreement diagnostic is about
    # the trainer's own routing. Its router logits on this same forward give it without a
    # second forward: the per-layer top-k of the same softmax `moe.route` takes. Deeper layers
    # see hidden states shaped by the replayed experts of earlier ones, so this is the
    # layer-local agreement (identical at the first MoE layer); a second, un-replayed forward
    # only for a diagnostic would cost as much as the p_old forward itself.
    # Batch-sharded like the residual stream: unconstrained, GSPMD gathered the global batch's
    # [B, S, L, E] router probabilities on every device for the top-k (the 30B plan: 120 GiB).
    probs_BSLE = constrain_batch(jax.nn.softmax(out.router_logits_BSLE.astype(jnp.float32), axis=-1))
    own_ids_BSLK = jax.lax.top_k(probs_BSLE, own_ids_BSLK.shape[-1])[1].astype(jnp.int32)
  mask = batch.response_mask_BT
  log_x = logp_old_BT - batch.logq_BT
  x = jnp.exp(log_x)
  diff = jnp.abs(jnp.exp(logp_old_BT) - jnp.exp(batch.logq_BT))
  m = {"mismatch/kl_k1": masked_mean(-log_x, mask), "mismatch/kl_k3": masked_mean(x - 1.0 - log_x, mask),
       "mismatch/prob_diff_mean": masked_mean(diff, mask),
       "mismatch/prob_diff_max": jnp.max(jnp.where(mask, diff, 0.0))}
  if sampler_ids_BSLK is not None and own_ids_BSLK is not None:
    m["mismatch/routing_agreement"] = routing_agreement(own_ids_BSLK, sampler_ids_BSLK, sampler_valid_BS)
  return logp_old_BT, own_ids_BSLK, m


def loss_fn(params, batch: TrainBatch, *, graphdef: nnx.GraphDef, loss_cfg: LossConfig, aux_coef: float):
  """Loss of one mini-batch and its metrics; routing replay is on iff `batch.replay_ids_BSLK` is set."""
  model = nnx.merge(graphdef, params)
  out = _forward(model, batch, **_replay_kw(batch))
  loss, metrics = _rl_loss(model, out, batch, loss_cfg)
  # The load-balancing loss uses the trainer's own routing, also under replay (models/moe.py).
  return loss + aux_coef * out.aux_loss, dict(metrics, aux_loss=out.aux_loss)


def first_order(params, batch: TrainBatch, *, graphdef: nnx.GraphDef, loss_cfg: LossConfig
                ) -> dict[str, jax.Array]:
  """The first-order-approximation meter ([MiniRL] Sec. 3) on one mini-batch.

  g_tok = grad of J_tok = -(the RL loss of `loss_fn`): the token-level objective the configured
  method optimizes (its rule, score centering, aggregation), without the load-balancing term,
  which is no part of either objective. g_seq = grad of the sequence-level objective
  J_seq = (1/Z) sum_i A_i prod_t pi_theta(y_it) / q(y_it) on the same tokens (q the sampler's
  logq; Z from `meters.seq_normalizer`, the constant of the loss's aggregation), through its
  stop-gradient surrogate (`meters.seq_objective_surrogate`). Both from one forward under the
  update's routing (replay included), two backward passes. Returns {'cosine', 'norm_ratio'}
  (`meters.grad_alignment`): on-policy (p = q), with PG and 'batch_tokens' or 'constant'
  aggregation, g_tok = g_seq, so both are 1; they move away under mismatch (the w_i differ from
  1), clipping / masking rules, and the per-response 1 / L_i of 'seq_mean'.
  """
  mask_BT = batch.response_mask_BT
  z = meters.seq_normalizer(mask_BT, loss_cfg.aggregation)

  def objectives(p):
    model = nnx.merge(graphdef, p)
    out = _forward(model, batch, **_replay_kw(batch))
    loss, _ = _rl_loss(model, out, batch, loss_cfg)
    logp_BT = _sampled_logp(model, out, batch, loss_cfg)
    j_seq, _ = meters.seq_objective_surrogate(logp_BT, batch.logq_BT, batch.adv_B, mask_BT, z)
    return -loss, j_seq

  (j_tok, j_seq), pullback = jax.vjp(objectives, params)
  one = lambda x: jnp.ones_like(x)
  zero = lambda x: jnp.zeros_like(x)
  g_tok, = pullback((one(j_tok), zero(j_seq)))
  g_seq, = pullback((zero(j_tok), one(j_seq)))
  return meters.grad_alignment(g_tok, g_seq)


def update(params, opt_state, batch: TrainBatch, *, graphdef: nnx.GraphDef, optimizer: Any,
           loss_cfg: LossConfig, aux_coef: float):
  """One optimizer step on `batch`; a non-finite loss or gradient leaves params and state unchanged.

  Returns (params, opt_state, metrics) with `metrics['finite']` telling the host which.
  """
  (loss, metrics), grads = jax.value_and_grad(
      lambda p: loss_fn(p, batch, graphdef=graphdef, loss_cfg=loss_cfg, aux_coef=aux_coef),
      has_aux=True)(params)
  gnorm = optax.global_norm(grads)
  ok = jnp.isfinite(loss) & jnp.isfinite(gnorm)
  updates, new_opt = optimizer.update(grads, opt_state, params)
  new_params = optax.apply_updates(params, updates)
  keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)
  return keep(new_params, params), keep(new_opt, opt_state), dict(metrics, loss=loss, grad_norm=gnorm,
                                                                 finite=ok)


# Jitted once per (graphdef, loss_cfg): the trainer calls it every `rl.meter_every` steps.
first_order_jit = jax.jit(first_order, static_argnames=("graphdef", "loss_cfg"))
