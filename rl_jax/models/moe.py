"""Qwen3-MoE sparse block: float32 router, dropless ragged_dot experts, routing replay."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from rl_jax.models.config import ModelConfig
from rl_jax.models.layers import param


def route(router_logits_NE: jax.Array, k: int, norm_topk_prob: bool,
          replay_ids_NK: jax.Array | None = None, replay_mask_N: jax.Array | None = None):
  """Top-k routing with optional replay (SPEC "Routing replay"; paper 000, R2/R3).

  Gate weights are always gathered from the dense softmax over *all* experts at the
  chosen ids and then renormalized as the model normally does, so under replay the
  router still gets gradient and a drifted id never reads a masked-out zero.

  Returns (ids_NK used for compute, gates_NK float32, natural_ids_NK, probs_NE).
  """
  probs_NE = jax.nn.softmax(router_logits_NE.astype(jnp.float32), axis=-1)
  _, natural_ids = jax.lax.top_k(probs_NE, k)
  ids = natural_ids
  if replay_ids_NK is not None:
    ids = jnp.where(replay_mask_N[:, None], replay_ids_NK.astype(natural_ids.dtype), natural_ids)
  gates = jnp.take_along_axis(probs_NE, ids, axis=-1)
  if norm_topk_prob:
    gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
  return ids, gates, natural_ids, probs_NE


def _expert_matmul(x_MK, w, group_sizes_E):
  if hasattr(w, "ragged_qmatmul"):
    return w.ragged_qmatmul(x_MK, group_sizes_E).astype(x_MK.dtype)
  return jax.lax.ragged_dot(x_MK, w.astype(x_MK.dtype), group_sizes_E)


def dropless_experts(x_ND, ids_NK, gates_NK, w_gate, w_up, w_down, n_experts: int):
  """SwiGLU experts over (token, slot) pairs sorted by expert with `lax.ragged_dot`.

  Every assignment is computed (no capacity factor), so no token is ever dropped.
  """
  n, k = ids_NK.shape
  flat_ids = ids_NK.reshape(-1)
  order = jnp.argsort(flat_ids, stable=True)
  x_sorted = x_ND[order // k]
  group_sizes = jnp.bincount(flat_ids, length=n_experts).astype(jnp.int32)
  h = jax.nn.silu(_expert_matmul(x_sorted, w_gate, group_sizes)) * _expert_matmul(x_sorted, w_up, group_sizes)
  y_sorted = _expert_matmul(h, w_down, group_sizes)
  y_NKD = jnp.zeros_like(y_sorted).at[order].set(y_sorted).reshape(n, k, -1)
  return jnp.einsum("nkd,nk->nd", y_NKD, gates_NK.astype(y_NKD.dtype))


def load_balancing_loss(probs_NE, natural_ids_NK, valid_N, n_experts: int):
  """Switch-Transformer auxiliary loss E * sum_e f_e * P_e over valid tokens.

  Computed from the trainer's own routing (natural ids), also under replay.
  """
  w = valid_N.astype(jnp.float32)
  denom = jnp.maximum(jnp.sum(w), 1.0)
  onehot_NKE = jax.nn.one_hot(natural_ids_NK, n_experts, dtype=jnp.float32)
  frac_KE = jnp.einsum("nke,n->ke", onehot_NKE, w) / denom
  prob_E = jnp.einsum("ne,n->e", probs_NE, w) / denom
  return n_experts * jnp.sum(frac_KE * prob_E[None, :])


class MoE(nnx.Module):
  """Sparse MoE feed-forward (Qwen3-MoE `Qwen3MoeSparseMoeBlock` semantics, dropless)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    e, d, f = cfg.n_experts, cfg.d_model, cfg.moe_d_ff
    self.w_router = nnx.Param(cfg.init_std * jax.random.normal(rngs.params(), (d, e), jnp.float32),
                              axes=("embed", None))
    self.w_gate = param(rngs, (e, d, f), ("expert", "embed", "mlp"), cfg)
    self.w_up = param(rngs, (e, d, f), ("expert", "embed", "mlp"), cfg)
    self.w_down = param(rngs, (e, f, d), ("expert", "mlp", "embed"), cfg)

  def __call__(self, x_BTD, valid_BT, replay_ids_BTK=None, replay_mask_BT=None):
    """Returns (y_BTD, ids_BTK used, router_logits_BTE, aux_loss)."""
    cfg = self.cfg
    b, t, d = x_BTD.shape
    x_ND = x_BTD.reshape(b * t, d)
    # Router in float32 regardless of compute dtype: routing is precision-sensitive.
    logits_NE = jnp.dot(x_ND.astype(jnp.float32), self.w_router.get_value().astype(jnp.float32))
    rid = None if replay_ids_BTK is None else replay_ids_BTK.reshape(b * t, -1)
    rmask = None if replay_mask_BT is None else replay_mask_BT.reshape(b * t)
    ids, gates, natural, probs = route(logits_NE, cfg.n_experts_per_tok, cfg.norm_topk_prob, rid, rmask)
    y = dropless_experts(x_ND, ids, gates, self.w_gate.get_value(), self.w_up.get_value(), self.w_down.get_value(), cfg.n_experts)
    aux = load_balancing_loss(probs, natural, valid_BT.reshape(-1), cfg.n_experts)
    k = cfg.n_experts_per_tok
    return (y.reshape(b, t, d).astype(x_BTD.dtype), ids.reshape(b, t, k),
            logits_NE.reshape(b, t, -1), aux)
