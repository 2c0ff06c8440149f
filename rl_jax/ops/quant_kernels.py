"""Pallas kernels: quantize, dequantize and quantized matmul (W-only and W+A)."""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from rl_jax.quant import formats as F
from rl_jax.quant.formats import Format

# Every kernel body calls the same `formats` functions as the jnp reference
# (quantize_core / dequantize_core / decode), so kernel == reference bit-for-bit
# is a test of the tiling, padding and packing, and the grid itself is pinned
# against ml_dtypes once, in the reference.


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def _tile(n: int, default: int, unit: int = 1, pow2: bool = False, minimum: int = 1) -> int:
  """A tile size <= default covering n, a multiple of `unit` (and a power of two if asked)."""
  t = min(default, _round_up(n, unit))
  t = _round_up(t, unit)
  if pow2:
    t = max(pl.next_power_of_2(t), minimum)
  return t


# Codec kernels hold the whole quantized axis in one block; this many elements
# per block keeps a block small enough for GPU on-chip memory (untuned).
_CODEC_BLOCK_ELEMS = 32768


def _codec_tile(kp: int, upper: int) -> int:
  t = max(8, min(upper, _CODEC_BLOCK_ELEMS // kp))
  return 1 << (t.bit_length() - 1)  # a power of two (a multiple of 8)


def _reduced_len(k: int, fmt: Format, block: int | None, pow2: bool) -> int:
  """Padded length of the quantized axis inside a kernel.

  Triton (GPU) needs power-of-two block shapes: `pow2` pads further with zeros,
  which only adds all-zero blocks (or leaves a whole-axis absmax unchanged) that
  are sliced off afterwards; it requires a power-of-two block size.
  """
  kp = F.padded_length(k, block, fmt.packed)
  if pow2 and (block is None or block & (block - 1) == 0):
    kp = pl.next_power_of_2(kp)
  return kp


def _compiler_params(interpret: bool, pow2: bool):
  """Triton's params for the GPU layout (`pow2`), else None (interpret mode, TPU's Mosaic).

  They pin the Triton backend: jax 0.10 lowers a `pallas_call` without them to Mosaic GPU
  (`jax_pallas_use_mosaic_gpu` defaulted to True), which these kernels do not target; jax 0.11
  picks Triton by default, so there they only restate it.
  """
  if interpret or not pow2:
    return None
  from jax.experimental.pallas import triton as pl_triton
  return pl_triton.CompilerParams(num_warps=4, num_stages=2)


def _quant_kernel(x_ref, c_ref, s_ref, *, fmt, axis, block, scale_dtype):
  codes, raw = F.quantize_core(x_ref[...], fmt, axis, block, scale_dtype)
  c_ref[...] = codes
  s_ref[...] = raw


def _dequant_kernel(c_ref, s_ref, o_ref, *, fmt, axis, scale_dtype):
  o_ref[...] = F.dequantize_core(c_ref[...], s_ref[...], fmt, axis, scale_dtype, o_ref.dtype)


def quantize_rows(x_MK: jax.Array, fmt: Format, block: int | None, scale_dtype: str, *,
                  tm: int | None = None, pow2: bool = False, interpret: bool = False
                  ) -> tuple[jax.Array, jax.Array]:
  """Quantizes along the last axis (activations per token, KV per token and head).

  Returns (codes [M, stored_length(K)], scales [M, n_blocks(K)]) exactly as
  `formats.quantize_ref(x, fmt, axis=1, ...)`.
  """
  m, k = x_MK.shape
  kp = _reduced_len(k, fmt, block, pow2)
  tm = _tile(m, tm or _codec_tile(kp, 256), 8, pow2)
  mp = _round_up(m, tm)
  kc = kp // 2 if fmt.packed else kp
  nb = F.n_blocks(kp, block)
  x = jnp.pad(x_MK, ((0, mp - m), (0, kp - k)))
  codes, raw = pl.pallas_call(
      functools.partial(_quant_kernel, fmt=fmt, axis=1, block=block, scale_dtype=scale_dtype),
      out_shape=(jax.ShapeDtypeStruct((mp, kc), fmt.storage_dtype),
                 jax.ShapeDtypeStruct((mp, nb), F.SCALE_DTYPES[scale_dtype])),
      grid=(mp // tm,),
      in_specs=[pl.BlockSpec((tm, kp), lambda i: (i, 0))],
      out_specs=(pl.BlockSpec((tm, kc), lambda i: (i, 0)),
                 pl.BlockSpec((tm, nb), lambda i: (i, 0))),
      compiler_params=_compiler_params(interpret, pow2),
      interpret=interpret, name="quantize_rows")(x)
  return codes[:m, :F.stored_length(k, fmt, block)], raw[:m, :F.n_blocks(k, block)]


def dequantize_rows(codes_MKc: jax.Array, scales_MB: jax.Array, fmt: Format, block: int | None,
                    scale_dtype: str, k: int, dtype, *, tm: int | None = None, pow2: bool = False,
                    interpret: bool = False) -> jax.Array:
  """Inverse of `quantize_rows`: -> [M, k] in `dtype`."""
  m = codes_MKc.shape[0]
  kp = _reduced_len(k, fmt, block, pow2)
  tm = _tile(m, tm or _codec_tile(kp, 256), 8, pow2)
  mp = _round_up(m, tm)
  kc = kp // 2 if fmt.packed else kp
  nb = F.n_blocks(kp, block)
  codes = jnp.pad(codes_MKc, ((0, mp - m), (0, kc - codes_MKc.shape[1])))
  raw = jnp.pad(scales_MB, ((0, mp - m), (0, nb - scales_MB.shape[1])), constant_values=1)
  out = pl.pallas_call(
      functools.partial(_dequant_kernel, fmt=fmt, axis=1, scale_dtype=scale_dtype),
      out_shape=jax.ShapeDtypeStruct((mp, kp), dtype),
      grid=(mp // tm,),
      in_specs=[pl.BlockSpec((tm, kc), lambda i: (i, 0)), pl.BlockSpec((tm, nb), lambda i: (i, 0))],
      out_specs=pl.BlockSpec((tm, kp), lambda i: (i, 0)),
      compiler_params=_compiler_params(interpret, pow2),
      interpret=interpret, name="dequantize_rows")(codes, raw)
  return out[:m, :k]


def quantize_cols(w_GKN: jax.Array, fmt: Format, block: int | None, scale_dtype: str, *,
                  tn: int | None = None, pow2: bool = False, interpret: bool = False
                  ) -> tuple[jax.Array, jax.Array]:
  """Quantizes weights `[G, K, N]` along K (per output channel, or K-blocks), per group G.

  Returns (codes [G, stored_length(K), N], scales [G, n_blocks(K), N]): the
  same as `formats.quantize_ref(w, fmt, axis=1, ...)`. Packing runs along K, so
  every stored array keeps N last and shards along N like the float weight.
  """
  g, k, n = w_GKN.shape
  kp = _reduced_len(k, fmt, block, pow2)
  tn = _tile(n, tn or _codec_tile(kp, 128), 1, pow2)
  np_ = _round_up(n, tn)
  kc = kp // 2 if fmt.packed else kp
  nb = F.n_blocks(kp, block)
  w = jnp.pad(w_GKN, ((0, 0), (0, kp - k), (0, np_ - n)))
  codes, raw = pl.pallas_call(
      functools.partial(_quant_kernel, fmt=fmt, axis=0, block=block, scale_dtype=scale_dtype),
      out_shape=(jax.ShapeDtypeStruct((g, kc, np_), fmt.storage_dtype),
                 jax.ShapeDtypeStruct((g, nb, np_), F.SCALE_DTYPES[scale_dtype])),
      grid=(g, np_ // tn),
      in_specs=[pl.BlockSpec((None, kp, tn), lambda e, j: (e, 0, j))],
      out_specs=(pl.BlockSpec((None, kc, tn), lambda e, j: (e, 0, j)),
                 pl.BlockSpec((None, nb, tn), lambda e, j: (e, 0, j))),
      compiler_params=_compiler_params(interpret, pow2),
      interpret=interpret, name="quantize_cols")(w)
  return codes[:, :F.stored_length(k, fmt, block), :n], raw[:, :F.n_blocks(k, block), :n]


def dequantize_cols(codes_GKN: jax.Array, scales_GBN: jax.Array, fmt: Format, block: int | None,
                    scale_dtype: str, k: int, dtype, *, tn: int | None = None, pow2: bool = False,
                    interpret: bool = False) -> jax.Array:
  """Inverse of `quantize_cols`: -> [G, k, N] in `dtype`."""
  g, kc_in, n = codes_GKN.shape
  kp = _reduced_len(k, fmt, block, pow2)
  tn = _tile(n, tn or _codec_tile(kp, 128), 1, pow2)
  np_ = _round_up(n, tn)
  kc = kp // 2 if fmt.packed else kp
  nb = F.n_blocks(kp, block)
  codes = jnp.pad(codes_GKN, ((0, 0), (0, kc - kc_in), (0, np_ - n)))
  raw = jnp.pad(scales_GBN, ((0, 0), (0, nb - scales_GBN.shape[1]), (0, np_ - n)),
                constant_values=1)
  out = pl.pallas_call(
      functools.partial(_dequant_kernel, fmt=fmt, axis=0, scale_dtype=scale_dtype),
      out_shape=jax.ShapeDtypeStruct((g, kp, np_), dtype),
      grid=(g, np_ // tn),
      in_specs=[pl.BlockSpec((None, kc, tn), lambda e, j: (e, 0, j)),
                pl.BlockSpec((None, nb, tn), lambda e, j: (e, 0, j))],
      out_specs=pl.BlockSpec((None, kp, tn), lambda e, j: (e, 0, j)),
      compiler_params=_compiler_params(interpret, pow2),
      interpret=interpret, name="dequantize_cols")(codes, raw)
  return out[:, :k, :n]


def _exact_in_bf16(fmt: Format | None, block: int | None, dtype) -> bool:
  """Whether the operand tile fed to the dot is exactly representable in bfloat16."""
  if fmt is None:
    return dtype == jnp.bfloat16
  # Codes of <= 8-bit formats (|int8| <= 127, fp8/fp4 values) are exact in bf16;
  # block-dequantized values (code * scale) are not.
  return block is None and fmt.bits <= 8


# The deepest K step of a float32-operand qmatmul tile on a GPU (see qmatmul).
_F32_TK = 128


def _qmm_kernel(*refs, w_fmt, w_block, w_sd, a_fmt, a_block, a_sd, op_dtype, tk, nk):
  """One (tm, tn) output tile, summed over K in `nk` steps of `tk` inside the program.

  Each program owns its output tile and loops over K itself: Triton runs the grid's programs
  in parallel, so a K grid axis accumulating into the output (`o_ref[...] +=`, sequential on
  TPU and in interpret mode) would race on a GPU.
  """
  if a_fmt is None:
    x_ref, w_ref, ws_ref, o_ref = refs
    xs_ref = None
  else:
    x_ref, xs_ref, w_ref, ws_ref, o_ref = refs
  tkw = tk // 2 if w_fmt.packed else tk
  tkx = tk // 2 if (a_fmt is not None and a_fmt.packed) else tk

  # Per-row / per-column scales factor out of the K sum: the dot runs on raw codes (what
  # int8 / fp8 tensor cores consume) and those scales apply once to the summed product.
  # Block scales vary along K, so those tiles are dequantized first.
  def k_body(kk, acc):
    if w_block is None:
      wc = w_ref[pl.ds(pl.multiple_of(kk * tkw, tkw), tkw), :]
      w = F.decode(F.unpack_nibbles(wc, 0) if w_fmt.packed else wc, w_fmt)
    else:
      nb = tk // w_block
      w = F.dequantize_core(w_ref[pl.ds(pl.multiple_of(kk * tkw, tkw), tkw), :],
                            ws_ref[pl.ds(pl.multiple_of(kk * nb, nb), nb), :], w_fmt, 0, w_sd)
    xk = x_ref[:, pl.ds(pl.multiple_of(kk * tkx, tkx), tkx)]
    if a_fmt is None:
      x = xk
    elif a_block is None:
      x = F.decode(F.unpack_nibbles(xk, 1) if a_fmt.packed else xk, a_fmt)
    else:
      nb = tk // a_block
      x = F.dequantize_core(xk, xs_ref[:, pl.ds(pl.multiple_of(kk * nb, nb), nb)], a_fmt, 1, a_sd)
    precision = jax.lax.Precision.HIGHEST if op_dtype == jnp.float32 else None
    return acc + jnp.dot(x.astype(op_dtype), w.astype(op_dtype),
                         preferred_element_type=jnp.float32, precision=precision)

  acc = jax.lax.fori_loop(0, nk, k_body, jnp.zeros(o_ref.shape, jnp.float32))
  if a_fmt is not None and a_block is None:
    acc = acc * F.decode_scale(xs_ref[...], a_sd)
  if w_block is None:
    acc = acc * F.decode_scale(ws_ref[...], w_sd)
  o_ref[...] = acc


def qmatmul(x_MK: jax.Array, w_codes: jax.Array, w_scales: jax.Array, *, k: int, w_fmt: Format,
            w_block: int | None, w_sd: str, x_scales: jax.Array | None = None,
            a_fmt: Format | None = None, a_block: int | None = None, a_sd: str = "fp32",
            tm: int = 128, tn: int = 128, tk: int = 256, pow2: bool = False,
            interpret: bool = False) -> jax.Array:
  """Tiled `x @ W` with W stored quantized `[stored K, N]`; returns float32 `[M, N]`.

  W-only: `x_MK` is float `[M, k]`. W+A: `x_MK` holds the activation codes from
  `quantize_rows` and `x_scales` their scales. Every operand is zero-padded to
  whole tiles (padding codes are 0, so they add nothing; padding scales are 1).
  """
  m = x_MK.shape[0]
  n = w_codes.shape[1]
  x_dtype = None if a_fmt is not None else x_MK.dtype
  op_dtype = (jnp.bfloat16 if _exact_in_bf16(a_fmt, a_block, x_dtype)
              and _exact_in_bf16(w_fmt, w_block, None) else jnp.float32)
  if pow2 and op_dtype == jnp.float32:
    # Triton stages float32 dot operands in shared memory: at 128 x 256 x 128 tiles the H200
    # asked for 276-290 KiB (W4A16 int4/32, W4A4 fp4) of its 227 KiB; a 128-deep K step halves it.
    tk = min(tk, _F32_TK)
  unit = math.lcm(w_block or 1, a_block or 1,
                  2 if (w_fmt.packed or (a_fmt is not None and a_fmt.packed)) else 1)
  # Triton's dot needs every tile dimension >= 16.
  tk = _tile(k, tk, unit, pow2, 16)
  tm = _tile(m, tm, 8, pow2, 16)
  tn = _tile(n, tn, 1, pow2, 16)
  mp, np_, kp = _round_up(m, tm), _round_up(n, tn), _round_up(k, tk)

  def pad_codes(c, axis, packed, rows):
    length = kp // 2 if packed else kp
    pads = [(0, 0), (0, 0)]
    pads[axis] = (0, length - c.shape[axis])
    pads[1 - axis] = (0, rows - c.shape[1 - axis])
    return jnp.pad(c, pads)

  def pad_scales(s, axis, block, rows):
    nb = 1 if block is None else kp // block
    pads = [(0, 0), (0, 0)]
    pads[axis] = (0, nb - s.shape[axis])
    pads[1 - axis] = (0, rows - s.shape[1 - axis])
    return jnp.pad(s, pads, constant_values=1)

  w = pad_codes(w_codes, 0, w_fmt.packed, np_)
  ws = pad_scales(w_scales, 0, w_block, np_)
  # Blocks hold the whole (padded) K of a row / column tile; the kernel walks it in tk steps.
  kpw = kp // 2 if w_fmt.packed else kp
  w_specs = [pl.BlockSpec((kpw, tn), lambda i, j: (0, j)),
             pl.BlockSpec((1 if w_block is None else kp // w_block, tn), lambda i, j: (0, j))]
  if a_fmt is None:
    xs = [jnp.pad(x_MK, ((0, mp - m), (0, kp - x_MK.shape[1])))]
    x_specs = [pl.BlockSpec((tm, kp), lambda i, j: (i, 0))]
  else:
    kpx = kp // 2 if a_fmt.packed else kp
    xs = [pad_codes(x_MK, 1, a_fmt.packed, mp), pad_scales(x_scales, 1, a_block, mp)]
    x_specs = [pl.BlockSpec((tm, kpx), lambda i, j: (i, 0)),
               pl.BlockSpec((tm, 1 if a_block is None else kp // a_block), lambda i, j: (i, 0))]
  out = pl.pallas_call(
      functools.partial(_qmm_kernel, w_fmt=w_fmt, w_block=w_block, w_sd=w_sd, a_fmt=a_fmt,
                        a_block=a_block, a_sd=a_sd, op_dtype=op_dtype, tk=tk, nk=kp // tk),
      out_shape=jax.ShapeDtypeStruct((mp, np_), jnp.float32),
      grid=(mp // tm, np_ // tn),
      in_specs=x_specs + w_specs,
      out_specs=pl.BlockSpec((tm, tn), lambda i, j: (i, j)),
      compiler_params=_compiler_params(interpret, pow2),
      interpret=interpret, name="qmatmul")(*xs, w, ws)
  return out[:m, :n]
