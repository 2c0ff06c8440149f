"""Decoder blocks: RMSNorm, RoPE (plain / llama3-scaled), GQA attention (kernels in attention.py), SwiGLU MLP."""
from __future__ import annotations

import chex
import einops
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rl_jax.models.config import ModelConfig
from rl_jax.ops import batch_invariant as invariant
from rl_jax.ops import native_attention
from rl_jax.ops.attention import MASK_VALUE, attention
from rl_jax.ops.linear import linear

# Dimension letters in array names (S tokens of this forward, C cache slots attention reads,
# R query heads per kv head, F ffn width, N flattened B * S tokens, ...): the one list is
# docs/architecture.md#dimension-letters.

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def dtype_of(name: str):
  return _DTYPES[name]


def param(rngs: nnx.Rngs, shape, axes, cfg: ModelConfig, std: float | None = None, **tags) -> nnx.Param:
  """A normal-initialized parameter annotated with logical axis names (see sharding.py) and tags:
  `expert=True` on routed-expert stacks (`presets.count_params` reads it), `quantize=True` on a
  linear weight `[in, out]` / `[experts, in, out]` and `lm_head=True` on the output projection
  (`models.quantize.plan_of` reads them: what the sampler quantizes)."""
  std = cfg.init_std if std is None else std
  value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
  return nnx.Param(value.astype(dtype_of(cfg.param_dtype)), axes=axes, **tags)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
  """RMSNorm computed in float32 (as transformers' Qwen3RMSNorm), cast back to x's dtype.

  In the zero-mismatch mode (`ops.batch_invariant`) the mean of squares is an ordered sum: XLA:CPU's
  reduce over the last axis rounds a row by the shape of the array around it (the rows of a
  [8, 23, 32] norm differ from the same rows of a [1, 35, 32] one by up to 4.8e-7), so a token's
  norm, and its keys and values, would depend on how many tokens share the forward."""
  x32 = x.astype(jnp.float32)
  if invariant.active():
    d = x32.shape[-1]
    ms = invariant.ordered_sum(lambda i: jnp.square(x32[..., i]), d)[..., None] / d
  else:
    ms = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
  x32 = x32 * jax.lax.rsqrt(ms + eps)
  return (scale.astype(jnp.float32) * x32).astype(x.dtype)


class RMSNorm(nnx.Module):
  def __init__(self, dim: int, cfg: ModelConfig):
    self.scale = nnx.Param(jnp.ones((dim,), dtype_of(cfg.param_dtype)), axes=(None,))
    self.eps = cfg.rms_eps

  def __call__(self, x: jax.Array) -> jax.Array:
    return rms_norm(x, self.scale.get_value(), self.eps)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
  """RoPE's inverse frequencies `[head_dim / 2]` (float32), with the config's frequency scaling.

  llama3 scaling keeps wavelengths shorter than original_context / high_freq_factor, divides
  those longer than original_context / low_freq_factor by `rope_factor`, and between the two
  blends the kept and divided frequency linearly in original_context / wavelength.
  """
  d = cfg.head_dim
  inv_freq_F = (1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d))))
  inv_freq_F = inv_freq_F.astype(np.float32)
  if cfg.rope_scaling == "none":
    return inv_freq_F
  old_ctx = np.float32(cfg.rope_original_max_positions)
  low, high, factor = (np.float32(cfg.rope_low_freq_factor), np.float32(cfg.rope_high_freq_factor),
                       np.float32(cfg.rope_factor))
  wavelen_F = np.float32(2 * np.pi) / inv_freq_F
  scaled_F = np.where(wavelen_F > old_ctx / low, inv_freq_F / factor, inv_freq_F)
  smooth_F = (old_ctx / wavelen_F - low) / (high - low)
  blended_F = (1 - smooth_F) * scaled_F / factor + smooth_F * scaled_F
  medium_F = (wavelen_F >= old_ctx / high) & (wavelen_F <= old_ctx / low)
  return np.where(medium_F, blended_F, scaled_F).astype(np.float32)


def rope(x_BSHD: jax.Array, positions_BS: jax.Array, inv_freq_F) -> jax.Array:
  """Rotary embedding, half-split ("rotate_half") layout as in transformers' Qwen3 / Llama."""
  d = x_BSHD.shape[-1]
  angles_BSF = positions_BS.astype(jnp.float32)[..., None] * inv_freq_F
  cos_BS1F = jnp.cos(angles_BSF)[:, :, None, :]
  sin_BS1F = jnp.sin(angles_BSF)[:, :, None, :]
  x32 = x_BSHD.astype(jnp.float32)
  x1, x2 = x32[..., : d // 2], x32[..., d // 2:]
  out = jnp.concatenate([x1 * cos_BS1F - x2 * sin_BS1F, x2 * cos_BS1F + x1 * sin_BS1F], axis=-1)
  return out.astype(x_BSHD.dtype)


class Attention(nnx.Module):
  """Grouped-query attention, optional per-head q/k RMSNorm (Qwen3) and q/k/v biases (Qwen2), KV cache."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    d, h, kv, hd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    self.wq = param(rngs, (d, h * hd), ("embed", "heads"), cfg, quantize=True)
    self.wk = param(rngs, (d, kv * hd), ("embed", "kv_heads"), cfg, quantize=True)
    self.wv = param(rngs, (d, kv * hd), ("embed", "kv_heads"), cfg, quantize=True)
    self.wo = param(rngs, (h * hd, d), ("heads", "embed"), cfg, quantize=True)
    if cfg.qk_norm:
      self.q_norm = RMSNorm(hd, cfg)
      self.k_norm = RMSNorm(hd, cfg)
    if cfg.qkv_bias:
      self.bq = param(rngs, (h * hd,), ("heads",), cfg)
      self.bk = param(rngs, (kv * hd,), ("kv_heads",), cfg)
      self.bv = param(rngs, (kv * hd,), ("kv_heads",), cfg)

  def _project(self, x_BSD, name: str):
    """x @ w (+ b): one head-split projection `[B, S, heads, head dim]`."""
    y = linear(x_BSD, getattr(self, "w" + name).get_value())
    if self.cfg.qkv_bias:
      y = y + getattr(self, "b" + name).get_value().astype(y.dtype)
    return einops.rearrange(y, "b s (h d) -> b s h d", d=self.cfg.head_dim)

  def __call__(self, x_BSD, positions_BS, kv_valid_BC, cache=None, cache_index=None):
    """Returns (out_BSD, cache'); keys are the S new tokens, or all C cache slots with a cache.

    The query at slot `cache_index + i` (i without a cache) reads key slot c iff c <= its slot
    and `kv_valid_BC[b, c]`: the mask is never materialized ([B, S, C] would be 1 GiB per row at
    32k tokens); `rl_jax.ops.attention` runs it (`ModelConfig.attention`).
    """
    cfg = self.cfg
    hd = cfg.head_dim
    q_BSHD, k_BSGD, v_BSGD = (self._project(x_BSD, n) for n in "qkv")
    if cfg.qk_norm:
      q_BSHD, k_BSGD = self.q_norm(q_BSHD), self.k_norm(k_BSGD)
    inv_freq_F = rope_inv_freq(cfg)
    q_BSHD = rope(q_BSHD, positions_BS, inv_freq_F)
    k_BSGD = rope(k_BSGD, positions_BS, inv_freq_F)
    b, s = x_BSD.shape[:2]
    # Query head h = g * R + r reads kv head g (transformers' repeat_kv order).
    q_BSGRD = einops.rearrange(q_BSHD, "b s (g r) d -> b s g r d", g=cfg.n_kv_heads)
    inv = cfg.batch_invariant
    if cache is None:  # keys / values: the S tokens themselves (C = S), causal
      out_BSGRD = attention(q_BSGRD, k_BSGD, v_BSGD, kv_valid_BC, impl=cfg.attention, invariant=inv)
    else:  # all C cache slots, heads-major as the cache keeps them
      cache, kT_BGDC, v_BGCD = cache.update(k_BSGD, v_BSGD, cache_index, x_BSD.dtype)
      c = kv_valid_BC.shape[1]
      chex.assert_shape(kT_BGDC, (b, cfg.n_kv_heads, hd, c))
      chex.assert_shape(v_BGCD, (b, cfg.n_kv_heads, c, hd))
      if jnp.ndim(cache_index) == 1 and s == 1:
        # One slot per row (the continuous engine's decode): its causal limit joins the key
        # mask, and the attention's own causal limit (the last slot) masks nothing more. S > 1
        # tokens per row (its refill prefill, one row per device): attention's per-row q_offset.
        kv_valid_BC = kv_valid_BC & (jnp.arange(c)[None] <= cache_index[:, None])
        cache_index = c - 1
      if s == 1 and not inv:  # decode: one query token per row (the invariant mode: the blocked attention below)
        mask_BC = (jnp.arange(c)[None] <= cache_index) & kv_valid_BC
        out_B1X = _decode_attention(q_BSGRD[:, 0], kT_BGDC, v_BGCD, mask_BC)
        return linear(out_B1X, self.wo.get_value()), cache
      # q / k in the compute dtype: a bf16 prefill at the static offset 0 (the sampler's) reaches
      # cuDNN on GPU (attention.auto_impl); on CPU attention() takes float32 scores itself.
      out_BSGRD = attention(q_BSGRD, kT_BGDC, v_BGCD, kv_valid_BC, q_offset=cache_index,
                            kv_layout="cache", impl=cfg.attention, invariant=inv)
    out_BSX = einops.rearrange(out_BSGRD, "b s g r d -> b s (g r d)")  # X = H * head dim
    return linear(out_BSX, self.wo.get_value()), cache


def _decode_attention(q_BGRD, kT_BGDC, v_BGCD, mask_BC):
  """One query token per row over C cache slots -> `[B, 1, H * head dim]`, in float32.

  Two matmuls batched over (b, g), `[R, D] @ [D, C]` and `[R, C] @ [C, D]`, whose operands
  the heads-major cache (`LayerKV`) holds as they are read: nothing of it is copied. On CPU with a
  float32 cache, the native handler computes the same (to float rounding; `native_attention`). Under
  `scan_layers` a layer's cache is a slice of the stacked cache, which XLA copies for the call: no
  gain there (peer dense model scanned: 1.3-1.4 s a generate either way), no loss measured either.
  """
  f32 = jnp.float32
  hd = q_BGRD.shape[-1]
  if native_attention.usable_for(kT_BGDC, v_BGCD):  # CPU: one pass per (row, kv head), not XLA's dot loop
    out_BGRD = native_attention.decode_attention(q_BGRD.astype(f32), kT_BGDC, v_BGCD, mask_BC, hd ** -0.5)
    return einops.rearrange(out_BGRD, "b g r d -> b 1 (g r d)")
  scores_BGRC = jnp.einsum("bgrd,bgdc->bgrc", q_BGRD.astype(f32), kT_BGDC.astype(f32))
  scores_BGRC = jnp.where(mask_BC[:, None, None, :], scores_BGRC * (hd ** -0.5), MASK_VALUE)
  probs_BGRC = jax.nn.softmax(scores_BGRC, axis=-1).astype(v_BGCD.dtype).astype(f32)
  out_BGRD = jnp.einsum("bgrc,bgcd->bgrd", probs_BGRC, v_BGCD.astype(f32))
  return einops.rearrange(out_BGRD.astype(v_BGCD.dtype), "b g r d -> b 1 (g r d)")


class MLP(nnx.Module):
  """SwiGLU feed-forward: down(silu(x W_gate) * x W_up)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, d_ff: int | None = None):
    d, f = cfg.d_model, (cfg.d_ff if d_ff is None else d_ff)
    self.w_gate = param(rngs, (d, f), ("embed", "mlp"), cfg, quantize=True)
    self.w_up = param(rngs, (d, f), ("embed", "mlp"), cfg, quantize=True)
    self.w_down = param(rngs, (f, d), ("mlp", "embed"), cfg, quantize=True)

  def __call__(self, x_BSD):
    h_BSF = (jax.nn.silu(linear(x_BSD, self.w_gate.get_value()))
             * linear(x_BSD, self.w_up.get_value()))
    return linear(h_BSF, self.w_down.get_value())
