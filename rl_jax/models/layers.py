"""Qwen3 building blocks: RMSNorm, RoPE, GQA attention with q/k-norm, SwiGLU MLP."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from rl_jax.models.config import ModelConfig

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# Finite "minus infinity": a fully masked row (padding query) stays NaN-free.
_MASK_VALUE = -1e30


def dtype_of(name: str):
  return _DTYPES[name]


def linear(x: jax.Array, w) -> jax.Array:
  """x[..., K] @ w[K, N]; `w` may be a quantized tensor (sampler weights) exposing `qmatmul`."""
  if hasattr(w, "qmatmul"):
    return w.qmatmul(x).astype(x.dtype)
  return jnp.dot(x, w.astype(x.dtype))


def materialize(w, dtype) -> jax.Array:
  """A dense array of `w` (dequantized when it is a quantized tensor)."""
  if hasattr(w, "dequantize"):
    return w.dequantize(dtype)
  return w.astype(dtype)


def param(rngs: nnx.Rngs, shape, axes, cfg: ModelConfig, std: float | None = None) -> nnx.Param:
  """A normal-initialized parameter annotated with logical axis names (see sharding.py)."""
  std = cfg.init_std if std is None else std
  value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
  return nnx.Param(value.astype(dtype_of(cfg.param_dtype)), axes=axes)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
  """RMSNorm computed in float32 (as transformers' Qwen3RMSNorm), cast back to x's dtype."""
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
  return (scale.astype(jnp.float32) * x32).astype(x.dtype)


class RMSNorm(nnx.Module):
  def __init__(self, dim: int, cfg: ModelConfig):
    self.scale = nnx.Param(jnp.ones((dim,), dtype_of(cfg.param_dtype)), axes=(None,))
    self.eps = cfg.rms_eps

  def __call__(self, x: jax.Array) -> jax.Array:
    return rms_norm(x, self.scale.get_value(), self.eps)


def rope(x_BTHD: jax.Array, positions_BT: jax.Array, theta: float) -> jax.Array:
  """Rotary embedding, half-split ("rotate_half") layout as in transformers' Qwen3."""
  d = x_BTHD.shape[-1]
  inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
  angles_BTF = positions_BT.astype(jnp.float32)[..., None] * inv_freq
  cos = jnp.cos(angles_BTF)[:, :, None, :]
  sin = jnp.sin(angles_BTF)[:, :, None, :]
  x32 = x_BTHD.astype(jnp.float32)
  x1, x2 = x32[..., : d // 2], x32[..., d // 2:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BTHD.dtype)


class Attention(nnx.Module):
  """Grouped-query attention with per-head q/k RMSNorm (Qwen3), optional KV cache."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    d, h, kv, hd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    self.wq = param(rngs, (d, h * hd), ("embed", "heads"), cfg)
    self.wk = param(rngs, (d, kv * hd), ("embed", "kv_heads"), cfg)
    self.wv = param(rngs, (d, kv * hd), ("embed", "kv_heads"), cfg)
    self.wo = param(rngs, (h * hd, d), ("heads", "embed"), cfg)
    self.q_norm = RMSNorm(hd, cfg)
    self.k_norm = RMSNorm(hd, cfg)

  def __call__(self, x_BTD, positions_BT, mask_BTS, cache=None, cache_index=None):
    cfg = self.cfg
    b, t, _ = x_BTD.shape
    h, kv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    q = self.q_norm(linear(x_BTD, self.wq.get_value()).reshape(b, t, h, hd))
    k = self.k_norm(linear(x_BTD, self.wk.get_value()).reshape(b, t, kv, hd))
    v = linear(x_BTD, self.wv.get_value()).reshape(b, t, kv, hd)
    q = rope(q, positions_BT, cfg.rope_theta)
    k = rope(k, positions_BT, cfg.rope_theta)
    if cache is not None:
      cache, k, v = cache.update(k, v, cache_index, x_BTD.dtype)
    s = k.shape[1]
    q = q.reshape(b, t, kv, h // kv, hd)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)
    scores = scores * (hd ** -0.5)
    scores = jnp.where(mask_BTS[:, None, None, :, :], scores, _MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(b, t, h * hd)
    del s
    return linear(out, self.wo.get_value()), cache


class MLP(nnx.Module):
  """SwiGLU feed-forward: down(silu(x W_gate) * x W_up)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    d, f = cfg.d_model, cfg.d_ff
    self.w_gate = param(rngs, (d, f), ("embed", "mlp"), cfg)
    self.w_up = param(rngs, (d, f), ("embed", "mlp"), cfg)
    self.w_down = param(rngs, (f, d), ("mlp", "embed"), cfg)

  def __call__(self, x_BTD):
    h = jax.nn.silu(linear(x_BTD, self.w_gate.get_value())) * linear(x_BTD, self.w_up.get_value())
    return linear(h, self.w_down.get_value())
