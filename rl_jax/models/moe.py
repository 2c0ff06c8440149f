"""Qwen3-MoE sparse block: float32 router, dropless experts (capacity slabs, Pallas grouped matmul or ragged_dot), routing replay."""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from rl_jax.config_utils import ConfigError
from rl_jax.models import expert_parallel as ep_lib
from rl_jax.models.config import EXPERT_MATMULS, ModelConfig
from rl_jax.models.expert_parallel import BATCH_AXES
from rl_jax.models.expert_rows import (  # noqa: F401  (also read as moe.<name>, as before the move)
    CAPACITY_TIERS, _capacity_experts, capacity_slots, capacity_tiers, dropless_rows, ragged_experts)
from rl_jax.models.layers import param
from rl_jax.ops import batch_invariant as invariant
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


def resolve_expert_matmul(choice: str, backend: str | None = None, dtype: str = "bfloat16") -> str:
  """`model.expert_matmul` -> "slab", "ragged_dot" or "grouped"; "auto" by `backend` (default
  jax.default_backend(), read at trace time) and the compute `dtype` (model.dtype): grouped on GPU
  for 16-bit compute (no dense expansion, where XLA:GPU's ragged_dot has one), ragged_dot on TPU
  (lowered natively), slab elsewhere, in the zero-mismatch mode (its fixed-order products are the
  slab's) and for float32 compute on GPU, where the kernel's exact float32 products (HIGHEST; XLA
  takes TF32 there by default) ran 15x slower than the slab on an H200 (device_check's MoE row)."""
  if choice not in EXPERT_MATMULS:
    raise ConfigError(f"config key 'model.expert_matmul': {choice!r} is not one of {list(EXPERT_MATMULS)}")
  if choice != "auto":
    return choice
  if invariant.active():
    return "slab"
  backend = backend or jax.default_backend()
  if backend in ("gpu", "cuda", "rocm"):
    return "grouped" if jnp.dtype(dtype).itemsize == 2 else "slab"
  return "ragged_dot" if backend == "tpu" else "slab"


def batch_groups(n_tokens: int) -> tuple[int, tuple[str, ...]]:
  """(G, axes): the context mesh's batch axes (`jax.set_mesh`) and the product G of their sizes,
  so each device's tokens form one group; (1, ()) without a mesh or when G does not divide."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return 1, ()
  # Manual axes (inside a shard_map) are already split by hand: no constraint over them.
  axes = tuple(a for a in BATCH_AXES if a in mesh.axis_names and mesh.shape[a] > 1
               and a not in mesh.manual_axes)
  g = math.prod(mesh.shape[a] for a in axes)
  if g == 1 or n_tokens % g:
    return 1, ()
  return g, axes


def dropless_experts(x_ND, ids_NK, gates_NK, w_gate, w_up, w_down, n_experts: int,
                     groups: int = 1, group_axes: tuple[str, ...] = (), matmul: str = "slab"):
  """SwiGLU experts over every (token, slot) assignment: no capacity drop, ever.

  Plain weights: an `[E, C, D]` batched matmul (`_capacity_rows`) with C the smallest of
  `capacity_tiers` that holds the busiest expert, else rounds of the last tier's slab
  (`_slab_rounds`); every branch computes
  the same products (a `lax.switch` picks one at run time, so skewed routing stays exact).
  Quantized (QTensor) weights always take `ragged_experts`.

  `groups` G > 1 sorts and slabs the N tokens as G groups of N / G (`dropless_rows`), each
  pinned by a sharding constraint to the mesh axes `group_axes` (`batch_groups`): under
  GSPMD every device then sorts and computes only its own batch shard's assignments, where
  one global argsort over all N tokens makes each device hold the whole batch's rows; past the
  last tier the groups take rounds of its slab (`_slab_rounds`), not the global ragged_dot.
  The same products either way (C per group, the tier shared by all groups). GSPMD then
  all-gathers the expert weights to every batch shard instead (8 devices, 1,024 tokens each,
  D 512, 64 experts, top-8, bf16: forward + backward temporaries 1.20 GiB grouped, 5.03 GiB
  ungrouped, whose global ragged fallback alone sets the peak).

  `matmul` "grouped" / "ragged_dot" (`dropless_rows`): with G > 1 groups pinned to mesh axes, a
  `shard_map` over those axes runs each device's own group (the SPMD partitioner cannot split a
  Pallas call, and splits no ragged_dot rows by expert): tokens stay put, the weights are
  gathered to every batch shard as GSPMD does for the slab.
  """
  n, d = x_ND.shape
  k = ids_NK.shape[1]
  if n % groups:
    groups, group_axes = 1, ()
  pin = lambda a: a
  if group_axes:
    pin = lambda a: jax.lax.with_sharding_constraint(a, P(group_axes, *([None] * (a.ndim - 1))))
  x_GnD = pin(x_ND.reshape(groups, n // groups, d))
  ids_GnK = pin(ids_NK.reshape(groups, n // groups, k))
  gates_GnK = pin(gates_NK.reshape(groups, n // groups, k))
  if matmul != "slab" and group_axes:
    y_GnKD = _rows_per_shard(x_GnD, ids_GnK, (w_gate, w_up, w_down), n_experts, group_axes, matmul)
  else:
    y_GnKD = dropless_rows(x_GnD, ids_GnK, w_gate, w_up, w_down, n_experts, matmul=matmul)
  y_GnD = pin(jnp.einsum("gnkd,gnk->gnd", y_GnKD, gates_GnK.astype(y_GnKD.dtype)))
  return y_GnD.reshape(n, -1)


def _rows_per_shard(x_GnD, ids_GnK, ws, n_experts: int, group_axes: tuple[str, ...], matmul: str):
  """`dropless_rows` of each device's own group under a `shard_map` over `group_axes` (of the
  context mesh), every weight replicated into it."""
  tok = P(group_axes)
  w_specs = tuple(jax.tree.map(lambda _: P(), w) for w in ws)  # a QTensor: each of its leaves

  def local(x, ids, *ws):
    return dropless_rows(x, ids, *ws, n_experts, matmul=matmul)

  # check_vma off: see expert_parallel._check_vma (the Pallas call under shard_map's check).
  return jax.shard_map(local, mesh=jax.sharding.get_abstract_mesh(), in_specs=(tok, tok) + w_specs,
                       out_specs=tok, check_vma=matmul != "grouped")(x_GnD, ids_GnK, *ws)


def seq_chunked(experts, x_BSD, ids_BSK, gates_BSK, chunk: int, n_experts: int):
  """`experts(x, ids, gates) -> (y, overflow)` over sequence chunks of `chunk` positions, in a
  `lax.scan` whose body is rematerialized: the dispatch's buffers are one chunk's, forward and backward.

  Exact: experts act per token. Every chunk holds all B rows, so a batch-sharded input stays
  sharded and every device works on every chunk. The tail is padded to a whole chunk with zero
  tokens at gate 0, routed round-robin (an even load, not one expert's overflow): their output,
  SwiGLU(0) x 0, and their gradients are exactly zero, and they are sliced off. `overflow` is the
  chunks' mean.
  """
  b, s, d = x_BSD.shape
  k = ids_BSK.shape[-1]
  n_chunks = -(-s // chunk)
  pad = n_chunks * chunk - s
  if pad:
    fill_BPK = (jnp.arange(b * pad * k, dtype=ids_BSK.dtype) % n_experts).reshape(b, pad, k)
    x_BSD = jnp.concatenate([x_BSD, jnp.zeros((b, pad, d), x_BSD.dtype)], axis=1)
    ids_BSK = jnp.concatenate([ids_BSK, fill_BPK], axis=1)
    gates_BSK = jnp.concatenate([gates_BSK, jnp.zeros((b, pad, k), gates_BSK.dtype)], axis=1)
  # [B, n * c, ...] -> [n, B, c, ...]: the scan's axis first, the batch's sharding kept on B.
  split = lambda a: jnp.moveaxis(a.reshape(b, n_chunks, chunk, *a.shape[2:]), 1, 0)

  @jax.checkpoint
  def body(carry, xs):
    y_BcD, overflow = experts(*xs)
    return carry + overflow, y_BcD

  overflow, y_nBcD = jax.lax.scan(body, jnp.zeros((), jnp.float32),
                                  (split(x_BSD), split(ids_BSK), split(gates_BSK)))
  y_BSD = jnp.moveaxis(y_nBcD, 0, 1).reshape(b, n_chunks * chunk, -1)[:, :s]
  return y_BSD, overflow / n_chunks


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
    self.w_gate = param(rngs, (e, d, f), ("expert", "embed", "mlp"), cfg, expert=True, quantize=True)
    self.w_up = param(rngs, (e, d, f), ("expert", "embed", "mlp"), cfg, expert=True, quantize=True)
    self.w_down = param(rngs, (e, f, d), ("expert", "mlp", "embed"), cfg, expert=True, quantize=True)

  def __call__(self, x_BSD, valid_BS, replay_ids_BSK=None, replay_mask_BS=None):
    """Returns (y_BSD, ids_BSK used, router_logits_BSE, aux_loss, overflow).

    `overflow` (float32 scalar) is the fraction of token shards whose expert-parallel
    all-to-all overflowed its buffers and took the exact fallback
    (`expert_parallel.all_to_all_experts`, `moe_dispatch="shard_map"`); 0 for the others.
    """
    cfg = self.cfg
    b, s, d = x_BSD.shape
    x_ND = x_BSD.reshape(b * s, d)
    # Router in float32 regardless of compute dtype: routing is precision-sensitive.
    router = invariant.ordered_dot if invariant.active() else jnp.dot
    logits_NE = router(x_ND.astype(jnp.float32), self.w_router.get_value().astype(jnp.float32))
    rid_NK = None if replay_ids_BSK is None else replay_ids_BSK.reshape(b * s, -1)
    rmask_N = None if replay_mask_BS is None else replay_mask_BS.reshape(b * s)
    ids_NK, gates_NK, natural_NK, probs_NE = route(logits_NE, cfg.n_experts_per_tok,
                                                   cfg.norm_topk_prob, rid_NK, rmask_N)
    ws = (self.w_gate.get_value(), self.w_up.get_value(), self.w_down.get_value())
    k = cfg.n_experts_per_tok
    x_BSD_in, ids_BSK, gates_BSK = x_BSD, ids_NK.reshape(b, s, k), gates_NK.reshape(b, s, k)
    if 0 < cfg.moe_seq_chunk < s:
      y_BSD, overflow = seq_chunked(functools.partial(self._experts, ws=ws), x_BSD_in, ids_BSK,
                                    gates_BSK, cfg.moe_seq_chunk, cfg.n_experts)
    else:
      y_BSD, overflow = self._experts(x_BSD_in, ids_BSK, gates_BSK, ws=ws)
    aux = load_balancing_loss(probs_NE, natural_NK, valid_BS.reshape(-1), cfg.n_experts)
    return (y_BSD.astype(x_BSD.dtype), ids_BSK, logits_NE.reshape(b, s, -1), aux, overflow)

  def _experts(self, x_BSD, ids_BSK, gates_BSK, *, ws):
    """(gated expert output y_BSD, overflow) of routed tokens: the dispatch the config names."""
    cfg = self.cfg
    b, s, d = x_BSD.shape
    x_ND, ids_NK, gates_NK = x_BSD.reshape(b * s, d), ids_BSK.reshape(b * s, -1), gates_BSK.reshape(b * s, -1)
    # Same math every way; the shard_map dispatches make the expert-parallel communication explicit.
    overflow = jnp.zeros((), jnp.float32)
    matmul = resolve_expert_matmul(cfg.expert_matmul, dtype=cfg.dtype)
    # Keyword-only and only when not the slab, so the slab's calls keep their signatures.
    mm = {} if matmul == "slab" else dict(expert_matmul=matmul)
    if cfg.moe_dispatch == "shard_map":
      y_ND, overflow = ep_lib.all_to_all_experts(x_ND, ids_NK, gates_NK, *ws, cfg.n_experts,
                                                 impl=cfg.moe_a2a, **mm)
    elif cfg.moe_dispatch == "all_gather":
      y_ND = ep_lib.all_gather_experts(x_ND, ids_NK, gates_NK, *ws, cfg.n_experts, **mm)
    else:
      groups, axes = batch_groups(b * s)
      # Keyword-only when grouped, so the ungrouped call keeps `ragged_experts`' signature.
      grouping = dict(groups=groups, group_axes=axes) if groups > 1 else {}
      if matmul != "slab":
        grouping["matmul"] = matmul
      y_ND = dropless_experts(x_ND, ids_NK, gates_NK, *ws, cfg.n_experts, **grouping)
    return y_ND.reshape(b, s, d), overflow
