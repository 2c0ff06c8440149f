"""The models' matmul dispatch: `linear`, `ragged_linear` and `dense`, for a plain array or a QTensor."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from rl_jax import impl_log
from rl_jax.ops import batch_invariant as invariant
from rl_jax.ops.grouped_matmul import grouped_product
from rl_jax.ops.quantized import dequantize_weight, qmatmul, ragged_qmatmul
from rl_jax.quant.qtensor import QTensor


def linear(x_sK: jax.Array, w) -> jax.Array:
  """`x[..., K] @ w[K, N]` in x's dtype, for a plain array or a QTensor (the model's linears)."""
  if isinstance(w, QTensor):
    return qmatmul(x_sK, w)
  if invariant.active():  # the zero-mismatch mode (ops/batch_invariant.py)
    return invariant.ordered_dot(x_sK, w)
  return jnp.dot(x_sK, w.astype(x_sK.dtype))


def ragged_linear(x_NK: jax.Array, w, group_sizes_E: jax.Array, impl: str = "ragged_dot") -> jax.Array:
  """`lax.ragged_dot(x, w[E, K, N], group_sizes)` in x's dtype, for a plain array or a QTensor;
  `impl` "pallas" computes it with the Pallas grouped matmul (ops/grouped_matmul.py)."""
  if isinstance(w, QTensor):
    return ragged_qmatmul(x_NK, w, group_sizes_E, impl)
  impl_log.record("experts", f"{'grouped' if impl == 'pallas' else impl} {jnp.dtype(x_NK.dtype).name}")
  return grouped_product(x_NK, w.astype(x_NK.dtype), group_sizes_E, impl)


def dense(w, dtype) -> jax.Array:
  """`w` as a plain array in `dtype` (dequantized when it is a QTensor)."""
  if isinstance(w, QTensor):
    return dequantize_weight(w, dtype)
  return w.astype(dtype)
