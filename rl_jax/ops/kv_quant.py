"""KV-cache quantization: per-(token, head) or D-block scales; write (quantize) and read paths."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from rl_jax.config_utils import ConfigError
from rl_jax.quant import formats as F
from rl_jax.ops import quantized


def _layout(spec, d: int) -> tuple[F.Format, int | None]:
  """(format, block along D or None) after checking D against the spec."""
  fmt = F.get_format(spec.format)
  block = spec.block_size if spec.granularity == "block" else None
  if block is not None and d % block:
    raise ConfigError(f"key 'kv.block_size': head_dim {d} is not divisible by block_size {block}")
  if fmt.packed and d % 2:
    raise ConfigError(f"key 'kv.format': {fmt.name} packs two values per byte along head_dim, "
                      f"which must be even, got {d}")
  return fmt, block


def kv_quantize(x_BSGD: jax.Array, spec, backend: str = "auto"
                ) -> tuple[jax.Array, jax.Array | None]:
  """Quantizes a K or V slab `[..., D]` (the cache writes `[B, G, S, D]`) -> (values, scales).

  Rows of D are independent, so any leading layout works; shapes below as `[B, S, G, D]`.
  values: `[B, S, G, D]` int8 / float8, or `[B, S, G, D/2]` uint8 for int4 / fp4
  (two codes per byte along D: jnp's int4 / float4 dtypes take a whole byte per
  element in `nbytes` and on CPU/GPU buffers, so packing is what saves memory).
  scales: `[B, S, G, 1]` (one absmax scale per token and head) or
  `[B, S, G, D/block]`, in the spec's scale dtype. fp32 / bf16: (cast, None).
  This is the write path: the Pallas kernel runs when `backend` resolves to it.
  """
  fmt = F.get_format(spec.format)
  if not fmt.quantized:
    return x_BSGD.astype(fmt.storage_dtype), None
  *lead, d = x_BSGD.shape
  fmt, block = _layout(spec, d)
  codes, scales = quantized.quantize_rows(x_BSGD.reshape(-1, d), fmt, block, spec.scale_dtype, backend)
  return codes.reshape(*lead, -1), scales.reshape(*lead, -1)


def kv_dequantize(values: jax.Array, scales: jax.Array | None, spec, dtype=jnp.float32,
                  backend: str = "auto") -> jax.Array:
  """Read path: (values, scales) from `kv_quantize` -> `[B, S, G, D]` in `dtype`."""
  fmt = F.get_format(spec.format)
  if not fmt.quantized:
    return values.astype(dtype)
  *lead, dc = values.shape
  d = dc * 2 if fmt.packed else dc
  fmt, block = _layout(spec, d)
  out = quantized.dequantize_rows(values.reshape(-1, dc), scales.reshape(-1, scales.shape[-1]), fmt,
                            block, spec.scale_dtype, d, dtype, backend)
  return out.reshape(*lead, d)


def kv_bytes(shape_BCGD: tuple[int, ...], spec, dtype=jnp.bfloat16) -> int:
  """Stored bytes (values + scales) of one K or V cache of logical shape `[B, C, G, D]`."""
  vals, scales = jax.eval_shape(lambda x: kv_quantize(x, spec, "xla"),
                                jax.ShapeDtypeStruct(shape_BCGD, dtype))
  return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize
             for a in (vals, scales) if a is not None)
