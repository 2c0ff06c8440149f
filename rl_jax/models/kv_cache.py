"""Static-shape KV cache (optionally quantized) for prefill + decode."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from rl_jax.models.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerKV:
  """One layer's cache: k/v `[B, C, G, D]` (C slots, G kv heads), low-bit when `spec` quantizes.

  `stacked`: every array has a leading layer axis (one scanned layer group, see
  `ModelConfig.scan_layers`); the scan hands each layer its `[B, C, G, D]` slice.
  """
  k: jax.Array
  v: jax.Array
  k_scale: jax.Array | None = None
  v_scale: jax.Array | None = None
  spec: Any = dataclasses.field(default=None, metadata=dict(static=True))
  # Quant kernels for the write/read path: 'auto' | 'pallas' | 'xla' (QuantConfig.backend).
  backend: str = dataclasses.field(default="auto", metadata=dict(static=True))
  stacked: bool = dataclasses.field(default=False, metadata=dict(static=True))

  @property
  def quantized(self) -> bool:
    return self.k_scale is not None

  def update(self, k_new_BSGD: jax.Array, v_new_BSGD: jax.Array, index: jax.Array, dtype
             ) -> tuple["LayerKV", jax.Array, jax.Array]:
    """Writes the new S-token slab at slot `index`; returns (cache', k_BCGD, v_BCGD) as read back.

    Reading back what was written (instead of using the fresh k/v) matches what a
    serving engine with a quantized cache computes for the current token too.
    """
    start = (0, index, 0, 0)
    if not self.quantized:
      k = jax.lax.dynamic_update_slice(self.k, k_new_BSGD.astype(self.k.dtype), start)
      v = jax.lax.dynamic_update_slice(self.v, v_new_BSGD.astype(self.v.dtype), start)
      new = dataclasses.replace(self, k=k, v=v)
      return new, k.astype(dtype), v.astype(dtype)
    from rl_jax.quant import kv as qkv  # pylint: disable=g-import-not-at-top
    kq, ks = qkv.kv_quantize(k_new_BSGD, self.spec, self.backend)
    vq, vs = qkv.kv_quantize(v_new_BSGD, self.spec, self.backend)
    new = dataclasses.replace(
        self,
        k=jax.lax.dynamic_update_slice(self.k, kq, start),
        v=jax.lax.dynamic_update_slice(self.v, vq, start),
        k_scale=jax.lax.dynamic_update_slice(self.k_scale, ks.astype(self.k_scale.dtype), start),
        v_scale=jax.lax.dynamic_update_slice(self.v_scale, vs.astype(self.v_scale.dtype), start))
    k_all = qkv.kv_dequantize(new.k, new.k_scale, self.spec, dtype, self.backend)
    v_all = qkv.kv_dequantize(new.v, new.v_scale, self.spec, dtype, self.backend)
    return new, k_all, v_all


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32, kv_spec=None,
               backend: str = "auto") -> list[LayerKV]:
  """Zero cache for every layer; `kv_spec` (a quant FormatSpec) selects low-bit storage and
  `backend` the kernels that write and read it.

  Unrolled layout: one LayerKV per layer. Scanned (`cfg.scan_layers`): one stacked
  LayerKV per `cfg.layer_groups` entry, arrays `[n_layers_in_group, B, C, G, D]`.
  """
  shape = (batch, max_len, cfg.n_kv_heads, cfg.head_dim)
  fmt = getattr(kv_spec, "format", None)
  if kv_spec is None or fmt in ("fp32", "bf16"):
    cdt = {"fp32": jnp.float32, "bf16": jnp.bfloat16}.get(fmt, dtype)
    layers = [LayerKV(jnp.zeros(shape, cdt), jnp.zeros(shape, cdt)) for _ in range(cfg.n_layers)]
    return stack_cache(cfg, layers) if cfg.scan_layers else layers
  from rl_jax.quant import kv as qkv  # pylint: disable=g-import-not-at-top
  # Quantizing a zero slab gives the stored layout (packing, dtypes, scale shape).
  vals, scales = jax.eval_shape(lambda x: qkv.kv_quantize(x, kv_spec, "xla"),
                                jax.ShapeDtypeStruct(shape, dtype))
  zeros = lambda s: jnp.zeros(s.shape, s.dtype)
  # Unit scales in unwritten slots: an e8m0 scale has no zero (0 casts to NaN), and masked
  # attention still computes 0 * value there, so a NaN would poison every row.
  ones = lambda s: jnp.ones(s.shape, s.dtype)
  layers = [LayerKV(zeros(vals), zeros(vals), ones(scales), ones(scales), spec=kv_spec, backend=backend)
            for _ in range(cfg.n_layers)]
  return stack_cache(cfg, layers) if cfg.scan_layers else layers


def cache_len(cache: list[LayerKV]) -> int:
  """Slots C of a cache (`init_cache` layout, unrolled or stacked)."""
  return cache[0].k.shape[-3]


def grow_cache(cache: list[LayerKV], slots: int) -> list[LayerKV]:
  """The cache with `slots` >= C slots: new slots as `init_cache` makes them (zero values,
  unit scales), existing ones unchanged."""
  c = cache_len(cache)
  if slots == c:
    return cache
  if slots < c:
    raise ValueError(f"grow_cache: {slots} slots < the cache's {c}")

  def pad(x, value):
    widths = [(0, 0)] * x.ndim
    widths[x.ndim - 3] = (0, slots - c)  # slot axis of [(layers,) B, C, G, *]
    return jnp.pad(x, widths, constant_values=value)

  return [dataclasses.replace(kv, k=pad(kv.k, 0), v=pad(kv.v, 0),
                              k_scale=None if kv.k_scale is None else pad(kv.k_scale, 1),
                              v_scale=None if kv.v_scale is None else pad(kv.v_scale, 1))
          for kv in cache]


def stack_cache(cfg: ModelConfig, layers: list[LayerKV]) -> list[LayerKV]:
  """Per-layer caches -> one stacked LayerKV per scanned layer group (`cfg.layer_groups`)."""
  if len(layers) != cfg.n_layers:
    raise ValueError(f"stack_cache: {len(layers)} layer caches for model.n_layers={cfg.n_layers}")
  out = []
  for start, n, _ in cfg.layer_groups:
    group = layers[start:start + n]
    kv = jax.tree.map(lambda *xs: jnp.stack(xs), *group)
    out.append(dataclasses.replace(kv, stacked=True))
  return out


def unstack_cache(cfg: ModelConfig, groups: list[LayerKV]) -> list[LayerKV]:
  """Stacked per-group caches -> one LayerKV per layer (inverse of `stack_cache`)."""
  if len(groups) != len(cfg.layer_groups):
    raise ValueError(f"unstack_cache: {len(groups)} group caches for {len(cfg.layer_groups)} "
                     "layer groups (model.scan_layers)")
  out = []
  for kv, (_, n, _) in zip(groups, cfg.layer_groups):
    kv = dataclasses.replace(kv, stacked=False)
    out += [jax.tree.map(lambda x, j=j: x[j], kv) for j in range(n)]
  return out
