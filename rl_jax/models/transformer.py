"""Decoder-only transformer implementing Qwen3 (dense) and Qwen3-MoE, with KV cache and replay."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from rl_jax.models.config import ModelConfig
from rl_jax.models.layers import MLP, Attention, RMSNorm, dtype_of, linear, materialize, param
from rl_jax.models.moe import MoE


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ModelOutput:
  """Forward results. `expert_ids_BTLK` holds the experts each MoE layer used (L = MoE layers)."""
  logits_BTV: jax.Array | None
  hidden_BTD: jax.Array | None
  expert_ids_BTLK: jax.Array
  router_logits_BTLE: jax.Array | None
  aux_loss: jax.Array
  cache: list | None


class Block(nnx.Module):
  """Pre-norm decoder layer: x + attn(norm(x)); x + ffn(norm(x)), ffn dense or MoE."""

  def __init__(self, cfg: ModelConfig, is_moe: bool, *, rngs: nnx.Rngs):
    self.is_moe = is_moe
    self.attn_norm = RMSNorm(cfg.d_model, cfg)
    self.attn = Attention(cfg, rngs=rngs)
    self.ffn_norm = RMSNorm(cfg.d_model, cfg)
    self.ffn = MoE(cfg, rngs=rngs) if is_moe else MLP(cfg, rngs=rngs)

  def __call__(self, x, positions, mask_BTS, valid_BT, cache, cache_index, replay_ids, replay_mask):
    a, cache = self.attn(self.attn_norm(x), positions, mask_BTS, cache, cache_index)
    x = x + a
    h = self.ffn_norm(x)
    if self.is_moe:
      y, ids, router_logits, aux = self.ffn(h, valid_BT, replay_ids, replay_mask)
    else:
      y, ids, router_logits, aux = self.ffn(h), None, None, jnp.zeros((), jnp.float32)
    return x + y, cache, ids, router_logits, aux


def default_positions(valid_BT: jax.Array) -> jax.Array:
  """Positions counting only valid tokens, so left-padded rows start at position 0."""
  return jnp.maximum(jnp.cumsum(valid_BT.astype(jnp.int32), axis=1) - 1, 0)


class Transformer(nnx.Module):
  """Qwen3 / Qwen3-MoE decoder. One forward for training, teacher forcing and sampling."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embedding = param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), cfg)
    moe_layers = set(cfg.moe_layers)
    self.layers = nnx.List([Block(cfg, i in moe_layers, rngs=rngs) for i in range(cfg.n_layers)])
    self.final_norm = RMSNorm(cfg.d_model, cfg)
    if not cfg.tie_embeddings:
      self.w_unembed = param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), cfg)

  def unembed_weight(self, dtype=jnp.float32) -> jax.Array:
    """The output projection `[D, V]` (the transposed embedding when tied)."""
    if self.cfg.tie_embeddings:
      return materialize(self.embedding.get_value(), dtype).T
    return materialize(self.w_unembed.get_value(), dtype)

  def __call__(self, tokens_BT, positions_BT=None, valid_BT=None, *, cache=None, cache_index=None,
               kv_valid_BS=None, replay_ids_BTLK=None, replay_mask_BT=None,
               return_router_logits=False, return_hidden=False, compute_logits=True) -> ModelOutput:
    """Runs the decoder.

    Args:
      tokens_BT: int token ids.
      positions_BT: RoPE positions; default counts valid tokens (left padding safe),
        or, with a cache, `cache_index + arange(T)`.
      valid_BT: True for real tokens (keys at padding are masked). Default all True.
      cache / cache_index: a `kv_cache.init_cache` list and the slot where these T
        tokens are written; attention then runs over all S cache slots.
      kv_valid_BS: which cache slots hold real tokens after this write (default:
        slots < cache_index + T).
      replay_ids_BTLK / replay_mask_BT: experts to replay per MoE layer and where
        (SPEC "Routing replay"); unmasked positions use the natural top-k.
    """
    cfg = self.cfg
    dtype = dtype_of(cfg.dtype)
    b, t = tokens_BT.shape
    if valid_BT is None:
      valid_BT = jnp.ones((b, t), bool)
    if positions_BT is None:
      positions_BT = (default_positions(valid_BT) if cache is None
                      else jnp.broadcast_to(cache_index + jnp.arange(t), (b, t)))
    if cache is None:
      causal_TS = jnp.tril(jnp.ones((t, t), bool))
      mask_BTS = causal_TS[None] & valid_BT[:, None, :]
    else:
      s = cache[0].k.shape[1]
      slots_S = jnp.arange(s)
      q_slots_T = cache_index + jnp.arange(t)
      if kv_valid_BS is None:
        kv_valid_BS = jnp.broadcast_to(slots_S[None] < cache_index + t, (b, s))
      mask_BTS = (slots_S[None, None, :] <= q_slots_T[None, :, None]) & kv_valid_BS[:, None, :]
    if replay_ids_BTLK is not None and replay_mask_BT is None:
      replay_mask_BT = jnp.ones((b, t), bool)

    emb = self.embedding.get_value()
    x = (jnp.take(materialize(emb, dtype), tokens_BT, axis=0) if hasattr(emb, "dequantize")
         else jnp.take(emb, tokens_BT, axis=0).astype(dtype))
    ids_all, router_all, aux_total = [], [], jnp.zeros((), jnp.float32)
    new_cache = [] if cache is not None else None
    moe_index = cfg.moe_index
    for i, block in enumerate(self.layers):
      r_ids = None
      if replay_ids_BTLK is not None and i in moe_index:
        r_ids = replay_ids_BTLK[:, :, moe_index[i]]
      layer_cache = None if cache is None else cache[i]
      if cfg.remat and cache is None:
        graphdef, state = nnx.split(block)
        def run(state, x, r_ids, _graphdef=graphdef):
          return nnx.merge(_graphdef, state)(x, positions_BT, mask_BTS, valid_BT, None, None,
                                             r_ids, replay_mask_BT)
        x, layer_cache, ids, rl, aux = jax.checkpoint(run)(state, x, r_ids)
      else:
        x, layer_cache, ids, rl, aux = block(x, positions_BT, mask_BTS, valid_BT, layer_cache,
                                             cache_index, r_ids, replay_mask_BT)
      if new_cache is not None:
        new_cache.append(layer_cache)
      if ids is not None:
        ids_all.append(ids)
        router_all.append(rl)
        aux_total = aux_total + aux
    h = self.final_norm(x)
    k = cfg.n_experts_per_tok
    expert_ids = (jnp.stack(ids_all, axis=2).astype(jnp.int32) if ids_all
                  else jnp.zeros((b, t, 0, k), jnp.int32))
    router_logits = None
    if return_router_logits and router_all:
      router_logits = jnp.stack(router_all, axis=2)
    logits = None
    if compute_logits:
      w_out = self.embedding.get_value() if cfg.tie_embeddings else self.w_unembed.get_value()
      if cfg.tie_embeddings:
        logits = jnp.einsum("btd,vd->btv", h, materialize(w_out, dtype),
                            preferred_element_type=jnp.float32)
      else:
        logits = linear(h, w_out).astype(jnp.float32)
      logits = logits.astype(jnp.float32)
    if cfg.n_moe_layers:
      aux_total = aux_total / cfg.n_moe_layers
    return ModelOutput(logits_BTV=logits, hidden_BTD=h if return_hidden else None,
                       expert_ids_BTLK=expert_ids, router_logits_BTLE=router_logits,
                       aux_loss=aux_total, cache=new_cache)
