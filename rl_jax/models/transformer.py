"""Decoder-only transformer of every family (Qwen3 / Qwen3-MoE, Llama 3, Qwen2-MoE), with KV cache and replay.

Two parameter layouts: unrolled (`layers.{i}`, one Block per layer) and scanned
(`ModelConfig.scan_layers`: `layer_groups.{g}`, one Block per run of same-kind layers
with every parameter stacked on a leading 'layers' axis, run by `lax.scan`).
`stack_layers` / `unstack_layers` convert parameter trees between them.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from rl_jax.models.config import ModelConfig
from rl_jax.models.expert_parallel import BATCH_AXES
from rl_jax.models.kv_cache import cache_len
from rl_jax.models.layers import MLP, Attention, RMSNorm, dtype_of, param
from rl_jax.models.moe import MoE
from rl_jax.ops import batch_invariant as invariant
from rl_jax.ops.linear import dense, linear


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ModelOutput:
  """Forward results over the S tokens of the call. `expert_ids_BSLK` holds the experts each MoE
  layer used (L = MoE layers; under replay, the replayed ones where the replay mask is set)."""
  logits_BSV: jax.Array | None
  hidden_BSD: jax.Array | None
  expert_ids_BSLK: jax.Array
  router_logits_BSLE: jax.Array | None
  aux_loss: jax.Array
  cache: list | None
  # float32 scalar, summed over MoE layers: the fraction of token shards whose shard_map
  # all-to-all overflowed and took the exact all-gather fallback (0 for dense / gspmd / all_gather).
  moe_overflow: jax.Array = dataclasses.field(default_factory=lambda: jnp.zeros((), jnp.float32))


class Block(nnx.Module):
  """Pre-norm decoder layer: x + attn(norm(x)); x + ffn(norm(x)), ffn dense or MoE (MoE: plus a
  sigmoid-gated shared expert when `shared_expert_d_ff`, outside the routing)."""

  def __init__(self, cfg: ModelConfig, is_moe: bool, *, rngs: nnx.Rngs):
    self.is_moe = is_moe
    self.attn_norm = RMSNorm(cfg.d_model, cfg)
    self.attn = Attention(cfg, rngs=rngs)
    self.ffn_norm = RMSNorm(cfg.d_model, cfg)
    self.ffn = MoE(cfg, rngs=rngs) if is_moe else MLP(cfg, rngs=rngs)
    self.has_shared = is_moe and cfg.shared_expert_d_ff > 0
    if self.has_shared:
      self.shared_ffn = MLP(cfg, rngs=rngs, d_ff=cfg.shared_expert_d_ff)
      self.w_shared_gate = param(rngs, (cfg.d_model, 1), ("embed", None), cfg)

  def _shared(self, h_BSD):
    """sigmoid(h w_shared_gate) * shared_mlp(h): the expert every token runs (Qwen2-MoE)."""
    b, s, d = h_BSD.shape
    h_ND = h_BSD.reshape(b * s, d)
    gate_N1 = jax.nn.sigmoid(linear(h_ND, self.w_shared_gate.get_value()))
    return (gate_N1 * self.shared_ffn(h_ND)).reshape(b, s, d)

  def __call__(self, x_BSD, positions_BS, kv_valid_BC, valid_BS, cache, cache_index, replay_ids_BSK,
               replay_mask_BS):
    """Returns (x_BSD', cache', ids_BSK, router_logits_BSE, aux, overflow); ids / logits None if dense."""
    a_BSD, cache = self.attn(self.attn_norm(x_BSD), positions_BS, kv_valid_BC, cache, cache_index)
    x_BSD = x_BSD + a_BSD
    h_BSD = self.ffn_norm(x_BSD)
    if self.is_moe:
      y_BSD, ids_BSK, router_BSE, aux, overflow = self.ffn(h_BSD, valid_BS, replay_ids_BSK,
                                                           replay_mask_BS)
      if self.has_shared:
        y_BSD = y_BSD + self._shared(h_BSD)
    else:
      # The dense MLP on [N, D] rows: fed [B, S, D], XLA:CPU's backward writes its [N, F]
      # activation gradients transposed (a strided copy per matmul), about 2x the MLP's time.
      b, s, d = h_BSD.shape
      y_BSD = self.ffn(h_BSD.reshape(b * s, d)).reshape(b, s, d)
      ids_BSK, router_BSE, aux = None, None, jnp.zeros((), jnp.float32)
      overflow = jnp.zeros((), jnp.float32)
    return x_BSD + y_BSD, cache, ids_BSK, router_BSE, aux, overflow


def _stack_blocks(blocks: list[Block]) -> Block:
  """One Block whose parameters stack `blocks`' on a leading 'layers' axis (same graph)."""
  graphdef, _ = nnx.split(blocks[0])
  states = [nnx.state(b) for b in blocks]

  def stack(*vs):
    meta = vs[0].get_metadata()
    axes = meta.get("axes")
    meta["axes"] = None if axes is None else ("layers",) + tuple(axes)
    return type(vs[0])(jnp.stack([v.get_value() for v in vs]), **meta)

  return nnx.merge(graphdef, jax.tree.map(stack, *states, is_leaf=lambda x: isinstance(x, nnx.Variable)))


def stack_layers(params: dict, cfg: ModelConfig) -> dict:
  """Unrolled parameter tree (`nnx.to_pure_dict` of the state) -> scanned layout of `cfg`.

  Pure: works on arrays, QTensors or ShapeDtypeStructs (any leaf jnp.stack takes).
  """
  if "layers" not in params:
    raise ValueError("stack_layers: the tree has no 'layers' (already scanned?)")
  layers = params["layers"]
  out = {k: v for k, v in params.items() if k != "layers"}
  out["layer_groups"] = {
      g: jax.tree.map(lambda *xs: jnp.stack(xs), *[layers[i] for i in range(start, start + n)])
      for g, (start, n, _) in enumerate(cfg.layer_groups)}
  return out


def unstack_layers(params: dict, cfg: ModelConfig) -> dict:
  """Scanned parameter tree -> unrolled layout (inverse of `stack_layers`)."""
  if "layer_groups" not in params:
    raise ValueError("unstack_layers: the tree has no 'layer_groups' (already unrolled?)")
  groups = params["layer_groups"]
  if len(groups) != len(cfg.layer_groups):
    raise ValueError(f"unstack_layers: {len(groups)} groups in the tree, model.layer_groups has "
                     f"{len(cfg.layer_groups)}")
  out = {k: v for k, v in params.items() if k != "layer_groups"}
  out["layers"] = {}
  for g, (start, n, _) in enumerate(cfg.layer_groups):
    for j in range(n):
      out["layers"][start + j] = jax.tree.map(lambda x, j=j: x[j], groups[g])
  return out


def constrain_batch(x_BSD: jax.Array) -> jax.Array:
  """The residual stream split over the context mesh's batch axes (`jax.set_mesh`); no-op without one.

  Without it GSPMD may follow the FSDP-sharded weights (d_model over 'fsdp') onto the
  activations and replicate the batch: every device then holds full-global-batch activations
  and all-reduces them (a tiny 8-layer model on fsdp=8: 261 MiB of temporaries growing with
  depth under remat, 12 MiB flat with this constraint at each layer boundary).
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x_BSD
  axes = tuple(a for a in BATCH_AXES if a in mesh.axis_names)
  n = 1
  for a in axes:
    n *= mesh.shape[a]
  if not axes or n == 1 or x_BSD.shape[0] % n:
    return x_BSD
  return jax.lax.with_sharding_constraint(
      x_BSD, jax.sharding.PartitionSpec(axes, *([None] * (x_BSD.ndim - 1))))


def default_positions(valid_BS: jax.Array) -> jax.Array:
  """Positions counting only valid tokens, so left-padded rows start at position 0."""
  return jnp.maximum(jnp.cumsum(valid_BS.astype(jnp.int32), axis=1) - 1, 0)


class Transformer(nnx.Module):
  """Qwen3 / Qwen3-MoE decoder. One forward for training, teacher forcing and sampling."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embedding = param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), cfg)
    moe_layers = set(cfg.moe_layers)
    # Built per layer in both layouts, so one seed gives the same weights either way.
    blocks = [Block(cfg, i in moe_layers, rngs=rngs) for i in range(cfg.n_layers)]
    if cfg.scan_layers:
      self.layer_groups = nnx.List([_stack_blocks(blocks[start:start + n])
                                    for start, n, _ in cfg.layer_groups])
    else:
      self.layers = nnx.List(blocks)
    self.final_norm = RMSNorm(cfg.d_model, cfg)
    if not cfg.tie_embeddings:
      self.w_unembed = param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), cfg, lm_head=True)

  def unembed_weight(self, dtype=jnp.float32) -> jax.Array:
    """The output projection `[D, V]` (the transposed embedding when tied)."""
    if self.cfg.tie_embeddings:
      return dense(self.embedding.get_value(), dtype).T
    return dense(self.w_unembed.get_value(), dtype)

  def logits(self, h_XD: jax.Array) -> jax.Array:
    """Float32 logits [..., V] of final-normed hidden states [..., D] (the forward's own head)."""
    with invariant.scope(self.cfg.batch_invariant):
      return self._logits(h_XD)

  def _logits(self, h_XD: jax.Array) -> jax.Array:
    if self.cfg.tie_embeddings and invariant.active():
      return invariant.ordered_dot(h_XD, self.embedding.get_value().T).astype(jnp.float32)
    if self.cfg.tie_embeddings:
      return jnp.einsum("...d,vd->...v", h_XD, self.embedding.get_value().astype(h_XD.dtype),
                        preferred_element_type=jnp.float32)
    return linear(h_XD, self.w_unembed.get_value()).astype(jnp.float32)

  def __call__(self, *args, **kwargs) -> ModelOutput:
    """Runs the decoder (`_forward`), under the batch-invariant products when the config asks."""
    with invariant.scope(self.cfg.batch_invariant):
      return self._forward(*args, **kwargs)

  def _forward(self, tokens_BS, positions_BS=None, valid_BS=None, *, cache=None, cache_index=None,
               kv_valid_BC=None, replay_ids_BSLK=None, replay_mask_BS=None,
               return_router_logits=False, return_hidden=False, compute_logits=True) -> ModelOutput:
    """Runs the decoder.

    Args:
      tokens_BS: int token ids (S tokens: the whole buffer when teacher forcing, the
        tokens of this step when decoding with a cache).
      positions_BS: RoPE positions; default counts valid tokens (left padding safe),
        or, with a cache, `cache_index + arange(S)`.
      valid_BS: True for real tokens (keys at padding are masked). Default all True.
      cache / cache_index: a `kv_cache.init_cache` list (per layer, or per layer group
        when scanned) and the slot where these S tokens are written; attention then
        runs over all C cache slots.
      kv_valid_BC: which cache slots hold real tokens after this write (default:
        slots < cache_index + S).
      replay_ids_BSLK / replay_mask_BS: experts to replay per MoE layer and where
        (docs/math.md#routing-replay); unmasked positions use the natural top-k. Any integer
        dtype (recorded ids are compact, `rollout.expert_id_dtype`): cast to int32 per layer.
    """
    cfg = self.cfg
    dtype = dtype_of(cfg.dtype)
    b, s = tokens_BS.shape
    if valid_BS is None:
      valid_BS = jnp.ones((b, s), bool)
    if positions_BS is None:
      positions_BS = (default_positions(valid_BS) if cache is None
                      else jnp.broadcast_to(cache_index + jnp.arange(s), (b, s)))
    # The attention mask stays structured (layers.Attention): the query at slot cache_index + i
    # (i without a cache) reads the key slots up to its own where kv_valid_BC holds.
    if cache is None:
      kv_valid_BC = valid_BS
    else:
      n_entries = len(cfg.layer_groups) if cfg.scan_layers else cfg.n_layers
      if len(cache) != n_entries:
        raise ValueError(f"cache has {len(cache)} entries; model.scan_layers={cfg.scan_layers} needs "
                         f"{n_entries} (build it with kv_cache.init_cache for this config)")
      c = cache_len(cache)
      kv_valid_BC = (jnp.broadcast_to(jnp.arange(c)[None] < cache_index + s, (b, c))
                     if kv_valid_BC is None else kv_valid_BC)
    if replay_ids_BSLK is not None and replay_mask_BS is None:
      replay_mask_BS = jnp.ones((b, s), bool)

    # The embedding is never quantized (models.quantize leaves it a plain array).
    x_BSD = constrain_batch(jnp.take(self.embedding.get_value(), tokens_BS, axis=0).astype(dtype))
    args = (positions_BS, kv_valid_BC, valid_BS, cache_index, replay_ids_BSLK, replay_mask_BS)
    if cfg.scan_layers:
      x_BSD, new_cache, ids_all, router_all, (aux_total, overflow) = self._run_scanned(x_BSD, cache, *args)
    else:
      x_BSD, new_cache, ids_all, router_all, (aux_total, overflow) = self._run_unrolled(x_BSD, cache, *args)
    h_BSD = self.final_norm(x_BSD)
    k = cfg.n_experts_per_tok
    expert_ids_BSLK = (jnp.stack(ids_all, axis=2).astype(jnp.int32) if ids_all
                       else jnp.zeros((b, s, 0, k), jnp.int32))
    router_logits_BSLE = None
    if return_router_logits and router_all:
      router_logits_BSLE = jnp.stack(router_all, axis=2)
    logits_BSV = self.logits(h_BSD) if compute_logits else None
    if cfg.n_moe_layers:
      aux_total = aux_total / cfg.n_moe_layers
    return ModelOutput(logits_BSV=logits_BSV, hidden_BSD=h_BSD if return_hidden else None,
                       expert_ids_BSLK=expert_ids_BSLK, router_logits_BSLE=router_logits_BSLE,
                       aux_loss=aux_total, cache=new_cache, moe_overflow=overflow)

  def _run_unrolled(self, x_BSD, cache, positions_BS, kv_valid_BC, valid_BS, cache_index,
                    replay_ids_BSLK, replay_mask_BS):
    """One Python-level call per layer; returns (x, cache', ids per MoE layer, router logits,
    (aux sum, overflow sum))."""
    cfg = self.cfg
    ids_all, router_all, aux_total = [], [], jnp.zeros((), jnp.float32)
    overflow_total = jnp.zeros((), jnp.float32)
    new_cache = [] if cache is not None else None
    moe_index = cfg.moe_index
    for i, block in enumerate(self.layers):
      r_ids_BSK = None
      if replay_ids_BSLK is not None and i in moe_index:
        # Stored compact (rollout.expert_id_dtype); the MoE block indexes with int32.
        r_ids_BSK = replay_ids_BSLK[:, :, moe_index[i]].astype(jnp.int32)
      layer_cache = None if cache is None else cache[i]
      if cfg.remat and cache is None:
        graphdef, state = nnx.split(block)
        def run(state, x_BSD, r_ids_BSK, _graphdef=graphdef):
          return nnx.merge(_graphdef, state)(x_BSD, positions_BS, kv_valid_BC, valid_BS, None, None,
                                             r_ids_BSK, replay_mask_BS)
        x_BSD, layer_cache, ids_BSK, rl_BSE, aux, overflow = jax.checkpoint(run)(state, x_BSD, r_ids_BSK)
      else:
        x_BSD, layer_cache, ids_BSK, rl_BSE, aux, overflow = block(
            x_BSD, positions_BS, kv_valid_BC, valid_BS, layer_cache, cache_index, r_ids_BSK,
            replay_mask_BS)
      x_BSD = constrain_batch(x_BSD)
      if new_cache is not None:
        new_cache.append(layer_cache)
      if ids_BSK is not None:
        ids_all.append(ids_BSK)
        router_all.append(rl_BSE)
        aux_total = aux_total + aux
        overflow_total = overflow_total + overflow
    return x_BSD, new_cache, ids_all, router_all, (aux_total, overflow_total)

  def _run_scanned(self, x_BSD, cache, positions_BS, kv_valid_BC, valid_BS, cache_index,
                   replay_ids_BSLK, replay_mask_BS):
    """One `lax.scan` per layer group (same results as `_run_unrolled`, per-MoE-layer lists).

    The residual stream is the carry; the stacked parameters, the group's stacked
    cache and its MoE layers' replay ids are scanned over (leading layer axis).
    """
    cfg = self.cfg
    ids_all, router_all, aux_total = [], [], jnp.zeros((), jnp.float32)
    overflow_total = jnp.zeros((), jnp.float32)
    new_cache = [] if cache is not None else None
    moe_index = cfg.moe_index
    for g, (start, n, is_moe) in enumerate(cfg.layer_groups):
      graphdef, state = nnx.split(self.layer_groups[g])
      r_ids_nBSK = None
      if is_moe and replay_ids_BSLK is not None:
        j0 = moe_index[start]  # a run of consecutive MoE layers has consecutive MoE indices
        r_ids_nBSK = jnp.moveaxis(replay_ids_BSLK[:, :, j0:j0 + n], 2, 0)
      group_cache = None if cache is None else cache[g]

      def body(x_BSD, xs, _graphdef=graphdef):
        layer_state, layer_cache, r_ids_BSK = xs
        if r_ids_BSK is not None:  # scanned over compact (rollout.expert_id_dtype), cast per layer
          r_ids_BSK = r_ids_BSK.astype(jnp.int32)
        x_BSD, layer_cache, ids_BSK, rl_BSE, aux, overflow = nnx.merge(_graphdef, layer_state)(
            x_BSD, positions_BS, kv_valid_BC, valid_BS, layer_cache, cache_index, r_ids_BSK,
            replay_mask_BS)
        return constrain_batch(x_BSD), (layer_cache, ids_BSK, rl_BSE, aux, overflow)

      if cfg.remat and cache is None:
        # prevent_cse=False: inside a scan the loop already keeps XLA from merging recomputes.
        body = jax.checkpoint(body, prevent_cse=False)
      x_BSD, (group_cache, ids_nBSK, rl_nBSE, aux_n, overflow_n) = jax.lax.scan(
          body, x_BSD, (state, group_cache, r_ids_nBSK))
      if new_cache is not None:
        new_cache.append(group_cache)
      if is_moe:
        ids_all += list(ids_nBSK)
        router_all += list(rl_nBSE)
        aux_total = aux_total + jnp.sum(aux_n)
        overflow_total = overflow_total + jnp.sum(overflow_n)
    return x_BSD, new_cache, ids_all, router_all, (aux_total, overflow_total)
