"""QTensor: a weight stored in low-bit form plus its scales, as a pytree that flows through jit."""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from rl_jax.quant import formats as F


@dataclasses.dataclass(frozen=True)
class QTensor:
  """A quantized weight of logical shape `[..., K, N]` (contraction axis K).

  `[K, N]` (a linear) or `[E, K, N]` (experts), each with an optional leading stacked-layer
  axis in the scanned layout (`[L, K, N]`, `[L, E, K, N]`). Every leading axis is a batch of
  independent matrices (scales never span it), and the logical shape is read off the
  children, so slicing them (a `lax.scan` over layers, a `shard_map` over experts) leaves a
  consistent QTensor of the slice.

  Children (jax arrays, what jit / sharding / orbax see):
    values: codes `[..., stored_length(K), N]`: int8, float8_e4m3fn / e5m2, or
      uint8 holding two int4 / fp4 codes per byte (element 2i in the low nibble,
      2i+1 in the high one) packed along K.
    scales: `[..., n_blocks, N]` (n_blocks = 1 per output channel, or K/block),
      float32 / bfloat16 / uint8 e8m0 exponent bytes (value 2**(byte - 127)).
      N stays last in both, so a sharding
      along N applies unchanged to values and scales.
  Static aux data: format, the logical contraction length `k` (the stored one is padded
  and packed) and dtype, block size (None = one scale
  per output channel), scale dtype, the activation quantization attached for W+A
  matmuls (`act_format` None = weight-only), and the kernel backend.

  Storage only: the math on it (dequantize, matmuls) lives in `ops/quantized.py`, which
  imports this module and never the other way round.
  """
  values: jax.Array
  scales: jax.Array
  format: str = "int8"
  k: int = 0
  logical_dtype: str = "float32"
  block_size: Optional[int] = None
  scale_dtype: str = "fp32"
  act_format: Optional[str] = None
  act_block_size: Optional[int] = None
  act_scale_dtype: str = "fp32"
  backend: str = "auto"

  @property
  def shape(self) -> tuple[int, ...]:
    """Logical shape `[..., K, N]`: the children's leading axes and N, with the unpadded K."""
    return tuple(self.values.shape[:-2]) + (self.k, self.values.shape[-1])

  @property
  def dtype(self):
    return jnp.dtype(self.logical_dtype)

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def size(self) -> int:
    return math.prod(self.shape)

  @property
  def fmt(self) -> F.Format:
    return F.get_format(self.format)

  @property
  def granularity(self) -> str:
    return "channel" if self.block_size is None else "block"

  @property
  def nbytes(self) -> int:
    """Bytes really stored (values + scales), from the children's shapes and dtypes."""
    return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in (self.values, self.scales))

  def shardings(self, sharding: NamedSharding) -> "QTensor":
    """A QTensor-shaped tree of shardings from the float weight's `sharding`.

    Each child keeps the weight's mesh axis on a dimension only where it divides
    that child's size (packed K is halved, the per-channel scale has K = 1), so
    an N (or expert) split carries over and a K split degrades to replication.
    """
    def fit(a):
      spec = tuple(sharding.spec) + (None,) * (a.ndim - len(sharding.spec))
      out = []
      for axis, dim in zip(spec, a.shape):
        names = axis if isinstance(axis, tuple) else (axis,)
        size = math.prod(sharding.mesh.shape[nm] for nm in names if nm is not None)
        out.append(axis if axis is not None and dim % size == 0 else None)
      return NamedSharding(sharding.mesh, PartitionSpec(*out))

    return dataclasses.replace(self, values=fit(self.values), scales=fit(self.scales))


jax.tree_util.register_dataclass(
    QTensor, data_fields=["values", "scales"],
    meta_fields=["format", "k", "logical_dtype", "block_size", "scale_dtype", "act_format",
                 "act_block_size", "act_scale_dtype", "backend"])

