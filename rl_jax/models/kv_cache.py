"""Static-shape KV cache (optionally quantized) for prefill + decode."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from rl_jax.models.config import ModelConfig
from rl_jax.ops import kv_quant as qkv


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerKV:
  """One layer's cache, heads-major: v `[B, G, C, D]` (G kv heads, C slots), k `[B, G, D, C]`.

  Layout from the decode profile (XLA:CPU): with one query token, attention is two matmuls
  batched over (b, g), `q [R, D] @ K^T [D, C]` and `p [R, C] @ V [C, D]`; stored this way
  both read the cache in place as plain row-major operands. Slot-major `[B, C, G, D]` made
  XLA either copy the whole cache at every step or run multiply-reduces ~3x slower, and
  `[C, D]` keys made the score product ~1.6x slower than `[D, C]` ones.
  Quantized (`spec`): k and v both hold `[B, G, C, D']` codes (D' = D, or D/2 packed) with
  `[B, G, C, n]` scales, since the formats pack and scale along D; the read path
  dequantizes and hands attention `K^T` all the same. `stacked`: every array has a leading
  layer axis (one scanned layer group, see `ModelConfig.scan_layers`); the scan hands each
  layer its slice.
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
    """Writes the new S-token slab at slot `index`; returns (cache', kT_BGDC, v_BGCD) as read back.

    Reading back what was written (instead of using the fresh k/v) matches what a
    serving engine with a quantized cache computes for the current token too. `index` is a
    scalar (every row writes at the same slot) or `[B]` (row b at `index[b]`: the continuous
    engine's slots, each at its own step).
    """
    # [B, S, G, D] -> heads-major [B, G, S, D] (quantization is per row of D).
    k_BGSD, v_BGSD = jnp.swapaxes(k_new_BSGD, 1, 2), jnp.swapaxes(v_new_BSGD, 1, 2)
    if not self.quantized:
      k = write_slots(self.k, jnp.swapaxes(k_BGSD, 2, 3).astype(self.k.dtype), index, axis=3)
      v = write_slots(self.v, v_BGSD.astype(self.v.dtype), index, axis=2)
      new = dataclasses.replace(self, k=k, v=v)
      return new, k.astype(dtype), v.astype(dtype)
    kq, ks = qkv.kv_quantize(k_BGSD, self.spec, self.backend)
    vq, vs = qkv.kv_quantize(v_BGSD, self.spec, self.backend)
    new = dataclasses.replace(
        self,
        k=write_slots(self.k, kq, index, axis=2),
        v=write_slots(self.v, vq, index, axis=2),
        k_scale=write_slots(self.k_scale, ks.astype(self.k_scale.dtype), index, axis=2),
        v_scale=write_slots(self.v_scale, vs.astype(self.v_scale.dtype), index, axis=2))
    # The dequantized keys are a fresh array either way: XLA writes them transposed.
    k_all = qkv.kv_dequantize(new.k, new.k_scale, self.spec, dtype, self.backend)
    v_all = qkv.kv_dequantize(new.v, new.v_scale, self.spec, dtype, self.backend)
    return new, jnp.swapaxes(k_all, -1, -2), v_all


def write_slots(buf: jax.Array, new: jax.Array, index, axis: int) -> jax.Array:
  """`buf` [B, ...] with `new` written along its slot `axis` from `index`: a scalar (one
  `dynamic_update_slice`, the same slot for every row) or `[B]` (row b from `index[b]`)."""
  if jnp.ndim(index) == 0:
    starts = [0] * buf.ndim
    starts[axis] = index
    return jax.lax.dynamic_update_slice(buf, new, starts)

  def one(buf_row, new_row, i):
    starts = [0] * buf_row.ndim
    starts[axis - 1] = i
    return jax.lax.dynamic_update_slice(buf_row, new_row, starts)
  return jax.vmap(one)(buf, new, index)


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32, kv_spec=None,
               backend: str = "auto") -> list[LayerKV]:
  """Zero cache for every layer; `kv_spec` (a quant FormatSpec) selects low-bit storage and
  `backend` the kernels that write and read it.

  Unrolled layout: one LayerKV per layer (its docstring has the array layouts). Scanned
  (`cfg.scan_layers`): one stacked LayerKV per `cfg.layer_groups` entry, arrays with a
  leading `[n_layers_in_group]` axis.
  """
  shape = (batch, cfg.n_kv_heads, max_len, cfg.head_dim)
  fmt = getattr(kv_spec, "format", None)
  if kv_spec is None or fmt in ("fp32", "bf16"):
    cdt = {"fp32": jnp.float32, "bf16": jnp.bfloat16}.get(fmt, dtype)
    shape_t = (batch, cfg.n_kv_heads, cfg.head_dim, max_len)  # keys transposed
    layers = [LayerKV(jnp.zeros(shape_t, cdt), jnp.zeros(shape, cdt)) for _ in range(cfg.n_layers)]
    return stack_cache(cfg, layers) if cfg.scan_layers else layers
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
  return cache[0].v.shape[-2]  # v: [(layers,) B, G, C, D], packed codes change D only


def _slot_axis(kv: LayerKV, name: str) -> int:
  """The slot axis of one of a LayerKV's arrays: -2 of `[(layers,) B, G, C, *]`, -1 of unquantized keys."""
  return -1 if name == "k" and not kv.quantized else -2


_ARRAYS = ("k", "v", "k_scale", "v_scale")


def _map_slots(cache: list[LayerKV], fn, other: list[LayerKV] | None = None) -> list[LayerKV]:
  """`fn(array, its slot axis, its fill value[, other's same array])` over every array of the cache
  (fill: 0 for values, 1 for scales, as `init_cache`)."""
  out = []
  for i, kv in enumerate(cache):
    new = {}
    for name in _ARRAYS:
      x = getattr(kv, name)
      args = (x, _slot_axis(kv, name[0]), 1 if name.endswith("scale") else 0)
      new[name] = None if x is None else fn(*args) if other is None else fn(*args, getattr(other[i], name))
    out.append(dataclasses.replace(kv, **new))
  return out


def grow_cache(cache: list[LayerKV], slots: int) -> list[LayerKV]:
  """The cache with `slots` >= C slots: new slots as `init_cache` makes them (zero values,
  unit scales), existing ones unchanged."""
  c = cache_len(cache)
  if slots == c:
    return cache
  if slots < c:
    raise ValueError(f"grow_cache: {slots} slots < the cache's {c}")

  def pad(x, axis, value):
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, slots - c)
    return jnp.pad(x, widths, constant_values=value)

  return _map_slots(cache, pad)


def cache_prefix(cache: list[LayerKV], slots: int) -> list[LayerKV]:
  """The cache's first `slots` <= C slots (a copy)."""
  c = cache_len(cache)
  if slots > c:
    raise ValueError(f"cache_prefix: {slots} slots > the cache's {c}")
  return cache if slots == c else _map_slots(
      cache, lambda x, axis, _: jax.lax.slice_in_dim(x, 0, slots, axis=x.ndim + axis))


def put_cache_prefix(cache: list[LayerKV], prefix: list[LayerKV]) -> list[LayerKV]:
  """`cache` with its first slots replaced by `prefix` (`cache_prefix`'s layout); the others kept."""
  if cache_len(prefix) == cache_len(cache):
    return prefix
  return _map_slots(cache, lambda x, axis, _, y: jax.lax.dynamic_update_slice_in_dim(
      x, y.astype(x.dtype), 0, axis=x.ndim + axis), other=prefix)


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
