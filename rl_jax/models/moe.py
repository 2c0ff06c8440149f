"""Qwen3-MoE sparse block: float32 router, dropless experts (capacity slab or ragged_dot), routing replay."""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from rl_jax.models.config import ModelConfig
from rl_jax.models.expert_parallel import shard_map_experts
from rl_jax.models.layers import param
from rl_jax.quant.ops import ragged_linear
from rl_jax.quant.qtensor import QTensor


def route(router_logits_NE: jax.Array, k: int, norm_topk_prob: bool,
          replay_ids_NK: jax.Array | None = None, replay_mask_N: jax.Array | None = None):
  """Top-k routing with optional replay (docs/math.md#routing-replay; [MiniRL], R2/R3).

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


# Slots per expert of the capacity path, as multiples of the mean load M / E, tried in order:
# the smallest tier that holds the busiest expert runs, and routing more skewed than the last
# tier takes the exact fallback. 1.25x is 1.6x less slab than 2x alone, whose empty half is
# all padding; at random init (issue 15's MoE: 32 x 160 tokens, 8 experts, top-2; max / mean
# load 1.11-1.49) two of the four layers fit it and the update went from 1.26 to 1.18 s.
CAPACITY_TIERS = (1.25, 2.0)


def ragged_experts(x_ND, ids_NK, gates_NK, w_gate, w_up, w_down, n_experts: int):
  """SwiGLU experts over (token, slot) pairs sorted by expert with `lax.ragged_dot` (the reference).

  Every assignment is computed (no capacity factor), so no token is ever dropped. XLA:CPU
  lowers `ragged_dot` to a dense product over all E expert blocks (E times the FLOPs, plus
  a transposed copy of every expert weight per call).
  """
  n, k = ids_NK.shape
  flat_ids_M = ids_NK.reshape(-1)  # M = N * K (token, slot) assignments
  order_M = jnp.argsort(flat_ids_M, stable=True)
  x_MD = x_ND[order_M // k]
  group_sizes_E = jnp.bincount(flat_ids_M, length=n_experts).astype(jnp.int32)
  h_MF = (jax.nn.silu(ragged_linear(x_MD, w_gate, group_sizes_E))
          * ragged_linear(x_MD, w_up, group_sizes_E))
  y_MD = ragged_linear(h_MF, w_down, group_sizes_E)
  y_NKD = jnp.zeros_like(y_MD).at[order_M].set(y_MD).reshape(n, k, -1)
  return jnp.einsum("nkd,nk->nd", y_NKD, gates_NK.astype(y_NKD.dtype))


def capacity_slots(n_assignments: int, n_experts: int, factor: float = CAPACITY_TIERS[-1]) -> int:
  """Slots C per expert of the capacity path: `factor` x the mean load, a multiple of 8, at most M."""
  c = math.ceil(-(-n_assignments // n_experts) * factor)
  return min(-(-c // 8) * 8, n_assignments)


def capacity_tiers(n_assignments: int, n_experts: int) -> tuple[int, ...]:
  """The distinct slot counts of `CAPACITY_TIERS`, ascending; one that reaches M ends the list."""
  slots = sorted({capacity_slots(n_assignments, n_experts, f) for f in CAPACITY_TIERS})
  return tuple(c for c in slots if c < n_assignments) + tuple(c for c in slots[-1:] if c >= n_assignments)


def _capacity_experts(x_ND, ids_NK, gates_NK, w_gate, w_up, w_down, n_experts: int, c: int):
  """The experts as one batched matmul over an `[E, C, D]` slab of each expert's tokens.

  Exact while no expert has more than C assignments (the caller checks): assignment i
  of expert e, in (token, slot) order, sits in slot (e, i) and is computed by expert e's
  own weights, as in `ragged_experts`; the E * C - M empty slots are zero rows (C / (M / E)
  x the useful FLOPs, one of `CAPACITY_TIERS`, instead of E x).
  """
  n, k = ids_NK.shape
  m = n * k
  flat_ids_M = ids_NK.reshape(-1)
  order_M = jnp.argsort(flat_ids_M, stable=True)  # assignments sorted by expert
  sizes_E = jnp.bincount(flat_ids_M, length=n_experts)
  starts_E = jnp.cumsum(sizes_E) - sizes_E
  slot_EC = starts_E[:, None] + jnp.arange(c)[None]  # position in the sorted order
  used_EC = jnp.arange(c)[None] < sizes_E[:, None]
  token_EC = order_M[jnp.minimum(slot_EC, m - 1)] // k
  x_ECD = jnp.where(used_EC[..., None], x_ND[token_EC], 0).astype(x_ND.dtype)
  mm = lambda a, w: jnp.einsum("ecd,edf->ecf", a, w.astype(a.dtype))
  h_ECF = jax.nn.silu(mm(x_ECD, w_gate)) * mm(x_ECD, w_up)
  y_XD = mm(h_ECF, w_down).reshape(n_experts * c, -1)  # X = E * C slots
  rank_M = jnp.zeros_like(order_M).at[order_M].set(jnp.arange(m, dtype=order_M.dtype))
  y_NKD = y_XD[flat_ids_M * c + rank_M - starts_E[flat_ids_M]].reshape(n, k, -1)
  return jnp.einsum("nkd,nk->nd", y_NKD, gates_NK.astype(y_NKD.dtype))


def dropless_experts(x_ND, ids_NK, gates_NK, w_gate, w_up, w_down, n_experts: int):
  """SwiGLU experts over every (token, slot) assignment: no capacity drop, ever.

  Plain weights: an `[E, C, D]` batched matmul (`_capacity_experts`) with C the smallest of
  `capacity_tiers` that holds the busiest expert, else `ragged_experts`; every branch computes
  the same products (a `lax.switch` picks one at run time, so skewed routing stays exact).
  Quantized (QTensor) weights always take `ragged_experts`.
  """
  if any(isinstance(w, QTensor) for w in (w_gate, w_up, w_down)):
    return ragged_experts(x_ND, ids_NK, gates_NK, w_gate, w_up, w_down, n_experts)
  m = ids_NK.size
  tiers = capacity_tiers(m, n_experts)
  branches = [functools.partial(_capacity_experts, n_experts=n_experts, c=c) for c in tiers]
  if tiers[-1] < m:  # the last tier can overflow: the exact fallback follows it
    branches.append(functools.partial(ragged_experts, n_experts=n_experts))
  args = (x_ND, ids_NK, gates_NK, w_gate, w_up, w_down)
  if len(branches) == 1:
    return branches[0](*args)
  load = jnp.max(jnp.bincount(ids_NK.reshape(-1), length=n_experts))
  index = jnp.sum(load > jnp.asarray(tiers, load.dtype))  # tiers too small for the busiest expert
  return jax.lax.switch(index, branches, *args)


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

  def __call__(self, x_BSD, valid_BS, replay_ids_BSK=None, replay_mask_BS=None):
    """Returns (y_BSD, ids_BSK used, router_logits_BSE, aux_loss)."""
    cfg = self.cfg
    b, s, d = x_BSD.shape
    x_ND = x_BSD.reshape(b * s, d)
    # Router in float32 regardless of compute dtype: routing is precision-sensitive.
    logits_NE = jnp.dot(x_ND.astype(jnp.float32), self.w_router.get_value().astype(jnp.float32))
    rid_NK = None if replay_ids_BSK is None else replay_ids_BSK.reshape(b * s, -1)
    rmask_N = None if replay_mask_BS is None else replay_mask_BS.reshape(b * s)
    ids_NK, gates_NK, natural_NK, probs_NE = route(logits_NE, cfg.n_experts_per_tok,
                                                   cfg.norm_topk_prob, rid_NK, rmask_N)
    # Same math either way; "shard_map" makes the expert-parallel communication explicit.
    experts = shard_map_experts if cfg.moe_dispatch == "shard_map" else dropless_experts
    y_ND = experts(x_ND, ids_NK, gates_NK, self.w_gate.get_value(),
                   self.w_up.get_value(), self.w_down.get_value(), cfg.n_experts)
    aux = load_balancing_loss(probs_NE, natural_NK, valid_BS.reshape(-1), cfg.n_experts)
    k = cfg.n_experts_per_tok
    return (y_ND.reshape(b, s, d).astype(x_BSD.dtype), ids_NK.reshape(b, s, k),
            logits_NE.reshape(b, s, -1), aux)
