"""Backend dispatch (`auto` / `pallas` / `xla`) for quantize, dequantize and quantized matmuls."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from rl_jax import impl_log
from rl_jax.config_utils import ConfigError
from rl_jax.ops import quant_kernels as kernels
from rl_jax.ops.grouped_matmul import grouped_product
from rl_jax.quant import formats as F
from rl_jax.quant.qtensor import QTensor

_HIGHEST = jax.lax.Precision.HIGHEST


def resolve_backend(backend: str, op: str = "codec") -> str:
  """'auto' -> 'pallas' for the quantized matmul on GPU/TPU, else 'xla'.

  On CPU Pallas is an emulator, and slow. The codecs (quantize / dequantize alone) take XLA's
  fusions everywhere: on an H200 every codec kernel ran 1.06-5.65x slower than the same jnp
  code compiled by XLA (benchmarks/device_check.py, docs/performance.md), while the W8A8
  qmatmul kernel ran 1.7-1.9x faster than XLA's dequantize-then-matmul.
  """
  if op not in ("codec", "matmul"):
    raise ValueError(f"op must be 'codec' or 'matmul', got {op!r}")
  if backend == "auto":
    return "pallas" if op == "matmul" and jax.default_backend() != "cpu" else "xla"
  if backend in ("pallas", "xla"):
    return backend
  raise ConfigError(f"key 'backend': {backend!r} is not one of ['auto', 'pallas', 'xla']")


def _kernel_opts() -> dict:
  platform = jax.default_backend()
  # No Pallas compiler on CPU: the kernels run in interpret mode. Triton (GPU)
  # wants power-of-two block shapes.
  return dict(interpret=platform == "cpu", pow2=platform == "gpu")


def quantize_rows(x_MK: jax.Array, fmt: F.Format, block: int | None, scale_dtype: str,
                  backend: str = "auto") -> tuple[jax.Array, jax.Array]:
  """Per-row absmax quantization along the last axis -> (codes, scales in storage dtype)."""
  if resolve_backend(backend) == "pallas":
    return kernels.quantize_rows(x_MK, fmt, block, scale_dtype, **_kernel_opts())
  return F.quantize_ref(x_MK, fmt, axis=1, block=block, scale_dtype=scale_dtype)


def dequantize_rows(codes: jax.Array, scales: jax.Array, fmt: F.Format, block: int | None,
                    scale_dtype: str, k: int, dtype, backend: str = "auto") -> jax.Array:
  """Inverse of `quantize_rows` -> `[M, k]` in `dtype`."""
  if resolve_backend(backend) == "pallas":
    return kernels.dequantize_rows(codes, scales, fmt, block, scale_dtype, k, dtype,
                                   **_kernel_opts())
  return F.dequantize_ref(codes, scales, fmt, axis=1, length=k, scale_dtype=scale_dtype,
                          dtype=dtype)


def _quantize_cols(w: jax.Array, fmt, spec, backend: str):
  """Codes and scales of `w[..., K, N]` along K, every leading index its own matrix."""
  if resolve_backend(backend) != "pallas":
    # Elementwise over the leading axes, so GSPMD keeps the weight's sharding (no reshape).
    return F.quantize_ref(w, fmt, axis=w.ndim - 2, block=spec.block, scale_dtype=spec.scale_dtype)
  if w.ndim > 3:
    # The kernel is not partitioned: XLA gathers its operand. One layer at a time keeps that
    # transient to one layer's experts (what the unrolled layout gathers), not the whole stack.
    return jax.lax.map(lambda x: _quantize_cols(x, fmt, spec, backend), w)
  codes, scales = kernels.quantize_cols(w if w.ndim == 3 else w[None], fmt, spec.block,
                                        spec.scale_dtype, **_kernel_opts())
  return (codes, scales) if w.ndim == 3 else (codes[0], scales[0])


def quantize_weight(w: jax.Array, spec, act=None, backend: str = "auto"):
  """Weight `[..., K, N]` -> QTensor (scales over K per output channel or K-block).

  Leading axes (experts `[E, K, N]`, a scanned layer stack `[L, K, N]` / `[L, E, K, N]`)
  are independent matrices: each gets its own scales, so quantizing a stack equals
  quantizing its slices one by one, bit for bit. `spec` is a `config.WeightSpec`; `act`
  an optional `config.ActivationSpec` attached for W+A matmuls. fp32 / bf16 formats
  return the plain cast array.
  """
  fmt = F.get_format(spec.format)
  if not fmt.quantized:
    return w.astype(fmt.storage_dtype)
  if w.ndim < 2:
    raise ValueError(f"quantized weights are [..., K, N], got shape {w.shape}")
  codes, scales = _quantize_cols(w, fmt, spec, backend)
  quant_act = act is not None and F.get_format(act.format).quantized
  return QTensor(codes, scales, format=fmt.name, k=w.shape[-2],
                 logical_dtype=jnp.dtype(w.dtype).name, block_size=spec.block,
                 scale_dtype=spec.scale_dtype,
                 act_format=act.format if quant_act else None,
                 act_block_size=act.block if quant_act else None,
                 act_scale_dtype=act.scale_dtype if quant_act else "fp32", backend=backend)


def _dequantize_cols(values, scales, qt: QTensor, dtype) -> jax.Array:
  if resolve_backend(qt.backend) != "pallas":
    return F.dequantize_ref(values, scales, qt.fmt, axis=values.ndim - 2, length=qt.k,
                            scale_dtype=qt.scale_dtype, dtype=dtype)
  if values.ndim > 3:
    return jax.lax.map(lambda vs: _dequantize_cols(*vs, qt, dtype), (values, scales))
  v3, s3 = (values, scales) if values.ndim == 3 else (values[None], scales[None])
  out = kernels.dequantize_cols(v3, s3, qt.fmt, qt.block_size, qt.scale_dtype, qt.k, dtype,
                                **_kernel_opts())
  return out if values.ndim == 3 else out[0]


def dequantize_weight(qt: QTensor, dtype=None) -> jax.Array:
  """QTensor -> float weight of its logical shape `[..., K, N]`, in `dtype` (default: logical dtype)."""
  dtype = qt.dtype if dtype is None else jnp.dtype(dtype)
  return _dequantize_cols(qt.values, qt.scales, qt, dtype)


def fake_quantize_activations(x_MK: jax.Array, qt: QTensor) -> jax.Array:
  """The float32 values the W+A matmul sees for x (quantize -> dequantize per token / block)."""
  if qt.act_format is None:
    return x_MK.astype(jnp.float32)
  afmt = F.get_format(qt.act_format)
  codes, scales = quantize_rows(x_MK, afmt, qt.act_block_size, qt.act_scale_dtype, qt.backend)
  return dequantize_rows(codes, scales, afmt, qt.act_block_size, qt.act_scale_dtype,
                         x_MK.shape[-1], jnp.float32, qt.backend)


def _check_k(x, k: int, qt: QTensor):
  if x.shape[-1] != k:
    raise ValueError(f"x[..., {x.shape[-1]}] does not contract with a quantized weight of "
                     f"logical shape {qt.shape}")


def qmatmul(x_sK: jax.Array, qt: QTensor) -> jax.Array:
  """`x[..., K] @ W[K, N]` -> `[..., N]` in x's dtype, accumulated in float32.

  With `qt.act_format` set, x is first quantized per token (absmax over K) or
  per K-block: a W+A quantized matmul; otherwise weight-only. Equal (to float
  tolerance) to the float matmul of the dequantized operands.
  """
  if qt.ndim != 2:
    raise ValueError(f"qmatmul needs a 2-D [K, N] weight, got logical shape {qt.shape} (a stacked "
                     "layer axis is sliced off by the layer scan before any matmul)")
  k, n = qt.shape
  _check_k(x_sK, k, qt)
  lead = x_sK.shape[:-1]
  x = x_sK.reshape(-1, k)
  if resolve_backend(qt.backend, "matmul") == "pallas":
    impl_log.record("quantized_linear", "pallas qmatmul")
    opts = _kernel_opts()
    common = dict(k=k, w_fmt=qt.fmt, w_block=qt.block_size, w_sd=qt.scale_dtype, **opts)
    if qt.act_format is None:
      out = kernels.qmatmul(x, qt.values, qt.scales, **common)
    else:
      afmt = F.get_format(qt.act_format)
      codes, x_scales = kernels.quantize_rows(x, afmt, qt.act_block_size, qt.act_scale_dtype,
                                              **opts)
      out = kernels.qmatmul(codes, qt.values, qt.scales, x_scales=x_scales, a_fmt=afmt,
                            a_block=qt.act_block_size, a_sd=qt.act_scale_dtype, **common)
  else:
    impl_log.record("quantized_linear", "xla dequantize + float32 dot")
    out = jnp.dot(fake_quantize_activations(x, qt), dequantize_weight(qt, jnp.float32),
                  precision=_HIGHEST, preferred_element_type=jnp.float32)
  return out.reshape(lead + (n,)).astype(x_sK.dtype)


def ragged_qmatmul(x_NK: jax.Array, qt: QTensor, group_sizes_E: jax.Array,
                   impl: str = "ragged_dot") -> jax.Array:
  """`lax.ragged_dot` of expert-sorted rows with a quantized `[E, K, N]` weight -> `[rows, N]`.

  Dequantizes the experts' weights (Pallas kernel or jnp) and, for W+A, fake-quantizes the rows
  per token, then runs the grouped product, accumulated in float32: `lax.ragged_dot`
  ("ragged_dot") or the Pallas grouped matmul ("pallas"). Operands: x's dtype where it is a
  16-bit float and the product runs on a device (the Pallas kernel, or any backend but the CPU):
  the grouped kernel's fast case (bf16 fwd 4.8x ragged_dot on an H200), where float32 operands
  run it at HIGHEST precision (1.97x slower than ragged_dot there). An FP8 / INT8 code times its
  scale rounds once more, to bf16 (2**-8 relative). Otherwise (float32 x; XLA:CPU's ragged_dot,
  which has no bf16 x bf16 -> f32 dot) float32 operands at HIGHEST, as before.
  """
  if qt.ndim != 3:
    raise ValueError(f"ragged_qmatmul needs a 3-D [E, K, N] weight, got logical shape {qt.shape} (a "
                     "stacked layer axis is sliced off by the layer scan before any matmul)")
  _check_k(x_NK, qt.shape[1], qt)
  sixteen = (jnp.issubdtype(x_NK.dtype, jnp.floating) and jnp.dtype(x_NK.dtype).itemsize == 2
             and (impl == "pallas" or jax.default_backend() != "cpu"))
  op_dtype = x_NK.dtype if sixteen else jnp.float32
  impl_log.record("experts", f"quantized {'grouped' if impl == 'pallas' else impl} {jnp.dtype(op_dtype).name}")
  kw = dict(preferred_element_type=jnp.float32) if sixteen else dict(precision=_HIGHEST,
                                                                      preferred_element_type=jnp.float32)
  out = grouped_product(fake_quantize_activations(x_NK, qt).astype(op_dtype), dequantize_weight(qt, op_dtype),
                 group_sizes_E, impl, **kw)
  return out.astype(x_NK.dtype)
