"""Number formats (int8/int4/fp8/fp4) and the pure-jnp reference quantize / dequantize."""
from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

FormatName = Literal["fp32", "bf16", "int8", "int4", "fp8", "fp8_e5m2", "fp4"]
ScaleDType = Literal["fp32", "bf16", "e8m0"]

# Smallest scale ever used: a group of (near-)zero values must not divide by 0
# or by a float32 subnormal (which XLA CPU may flush to zero).
_MIN_SCALE = 2.0**-126


@dataclasses.dataclass(frozen=True)
class Format:
  """One number format: its grid (from ml_dtypes) and how it is stored.

  `max` is the largest magnitude symmetric absmax scaling maps to (int formats
  are symmetric, so int8 uses [-127, 127] and int4 [-7, 7]: the codes -128 / -8
  are never emitted). For float formats `mantissa_bits`, `emin` (exponent of the
  smallest normal) and `bias` describe the grid; ml_dtypes is the ground truth.
  """
  name: str
  bits: int
  kind: Literal["none", "int", "float"]
  max: float
  grid_dtype: type            # ml_dtypes / numpy dtype whose values form the grid
  storage_dtype: type         # dtype of the stored values (uint8 when packed)
  packed: bool = False        # two 4-bit codes per uint8
  mantissa_bits: int = 0
  emin: int = 0
  bias: int = 0

  @property
  def quantized(self) -> bool:
    return self.kind != "none"


FORMATS: dict[str, Format] = {
    "fp32": Format("fp32", 32, "none", float(np.finfo(np.float32).max), np.float32, jnp.float32),
    "bf16": Format("bf16", 16, "none", float(ml_dtypes.finfo(ml_dtypes.bfloat16).max),
                   ml_dtypes.bfloat16, jnp.bfloat16),
    "int8": Format("int8", 8, "int", 127.0, np.int8, jnp.int8),
    "int4": Format("int4", 4, "int", 7.0, ml_dtypes.int4, jnp.uint8, packed=True),
    "fp8": Format("fp8", 8, "float", 448.0, ml_dtypes.float8_e4m3fn, jnp.float8_e4m3fn,
                  mantissa_bits=3, emin=-6, bias=7),
    "fp8_e5m2": Format("fp8_e5m2", 8, "float", 57344.0, ml_dtypes.float8_e5m2, jnp.float8_e5m2,
                       mantissa_bits=2, emin=-14, bias=15),
    "fp4": Format("fp4", 4, "float", 6.0, ml_dtypes.float4_e2m1fn, jnp.uint8, packed=True,
                  mantissa_bits=1, emin=0, bias=1),
}

# e8m0 scales are kept as their exponent byte in uint8 (bit-identical to
# ml_dtypes.float8_e8m0fnu, a `.view` away). Not the float8_e8m0fnu dtype itself:
# it has no zero, so a zero-initialized cache (jnp.zeros) would hold NaN scales
# and 0 * NaN would leak through masked attention; byte 0 decodes to 0 here.
SCALE_DTYPES: dict[str, type] = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "e8m0": jnp.uint8}


def get_format(name: str) -> Format:
  if name not in FORMATS:
    raise ValueError(f"unknown quantization format {name!r}; valid: {sorted(FORMATS)}")
  return FORMATS[name]


def _pow2(exp_i32: jax.Array) -> jax.Array:
  """2**exp as float32, built from the exponent bits (exact; exp in [-126, 127])."""
  return lax.bitcast_convert_type(((exp_i32 + 127) << 23).astype(jnp.uint32), jnp.float32)


def _exponent(a_f32: jax.Array) -> jax.Array:
  """floor(log2(a)) for a normal non-negative float32 (exact, from the bits; -127 for 0)."""
  bits = lax.bitcast_convert_type(a_f32, jnp.uint32)
  return (bits >> 23).astype(jnp.int32) - 127


def with_sign(mag_f32: jax.Array, negative: jax.Array) -> jax.Array:
  """`mag` (>= 0, float32) with its sign bit set where `negative`, from the bits.

  Not `-mag` / `jnp.copysign`: Pallas' Triton lowering negates as `0 - x`, which turns -0.0
  into +0.0, so a kernel would store a negative zero's code as +0 where the reference (and
  ml_dtypes) keeps -0 (seen on an H200: ~6% of fp4 codes, the ones that round to zero).
  """
  sign = negative.astype(jnp.uint32) << 31
  return lax.bitcast_convert_type(lax.bitcast_convert_type(mag_f32, jnp.uint32) | sign, jnp.float32)


def _is_negative(y_f32: jax.Array) -> jax.Array:
  return (lax.bitcast_convert_type(y_f32, jnp.uint32) >> 31) == 1


def round_half_even(y_f32: jax.Array) -> jax.Array:
  """`jnp.round` (to nearest, ties to even) for float32, from floor and exact float32 steps.

  Pallas' Triton lowering has no `round` primitive; `floor`, compares and selects lower
  everywhere. Bit-identical to `jnp.round` for every float32, signed zeros included:
  `y - floor(y)` is exact, and |y| >= 2**23 (integers, infinities) and NaN pass unchanged.
  """
  f = jnp.floor(y_f32)
  d = y_f32 - f
  odd = (f - 2.0 * jnp.floor(f * 0.5)) != 0.0
  r = jnp.where((d > 0.5) | ((d == 0.5) & odd), f + 1.0, f)
  r = jnp.where(r == 0.0, y_f32 * 0.0, r)  # a zero keeps y's sign (-0.3 -> -0.0), as round's
  return jnp.where(jnp.abs(y_f32) < 2.0**23, r, y_f32)


def round_to_grid(y: jax.Array, fmt: Format) -> jax.Array:
  """Rounds float32 `y` (already divided by its scale) onto `fmt`'s grid, as float32.

  Round-to-nearest-even and saturation at +-fmt.max, computed with exact float32
  arithmetic (no cast to the target dtype). Casting to fp4 / fp8 can go through a
  16-bit type first on some backends (double rounding: 0.25 + 2**-20 -> 0.25 ->
  tie -> 0 instead of 0.5); this never does, so the Pallas kernels and the
  reference agree with ml_dtypes' single rounding bit-for-bit.
  """
  y = y.astype(jnp.float32)
  if fmt.kind == "int":
    return jnp.clip(round_half_even(y), -fmt.max, fmt.max)
  if fmt.kind == "none":
    return y
  m = fmt.mantissa_bits
  a = jnp.minimum(jnp.abs(y), fmt.max)
  # Spacing of the grid around a: 2**(e - m) in the normal range, 2**(emin - m)
  # in the subnormal range; multiplying by a power of two is exact here.
  e = jnp.maximum(_exponent(a), fmt.emin)
  r = round_half_even(a * _pow2(m - e)) * _pow2(e - m)
  return with_sign(r, _is_negative(y))


def encode(r: jax.Array, fmt: Format) -> jax.Array:
  """On-grid float32 values -> stored codes (int8, float8, or a 4-bit code in a uint8).

  fp4 codes are built from the bits (sign | 2 exponent | 1 mantissa, e2m1), as
  ml_dtypes lays them out; no float4 cast is involved.
  """
  if fmt.name == "int8":
    return r.astype(jnp.int8)
  if fmt.name == "int4":
    return (r.astype(jnp.int32) & 0xF).astype(jnp.uint8)
  if fmt.name == "fp4":
    m = fmt.mantissa_bits
    a = jnp.abs(r)
    bits = lax.bitcast_convert_type(a, jnp.uint32)
    e = _exponent(a)
    mant = ((bits >> (23 - m)) & ((1 << m) - 1)).astype(jnp.int32)
    normal = ((e - fmt.emin + 1) << m) | mant
    subnormal = (a * _pow2(jnp.full_like(e, m - fmt.emin))).astype(jnp.int32)
    mag = jnp.where(a >= 2.0**fmt.emin, normal, subnormal)
    sign = (lax.bitcast_convert_type(r, jnp.uint32) >> 31).astype(jnp.int32)
    return (mag | (sign << 3)).astype(jnp.uint8)
  # fp8: r is on the grid, so the cast is exact whatever path the backend takes.
  return r.astype(fmt.storage_dtype)


def decode(codes: jax.Array, fmt: Format) -> jax.Array:
  """Stored (unpacked) codes -> float32 values (exact)."""
  if fmt.name == "int4":
    n = codes.astype(jnp.int32)
    return jnp.where(n >= 8, n - 16, n).astype(jnp.float32)
  if fmt.name == "fp4":
    m = fmt.mantissa_bits
    c = codes.astype(jnp.int32)
    ef = (c >> m) & 0x3
    mf = (c & ((1 << m) - 1)).astype(jnp.float32)
    normal = (1.0 + mf * 2.0**-m) * _pow2(ef - 1 + fmt.emin)
    subnormal = mf * 2.0**(fmt.emin - m)
    v = jnp.where(ef == 0, subnormal, normal)
    return with_sign(v, (c >> 3) & 1 == 1)
  return codes.astype(jnp.float32)


def pack_nibbles(n: jax.Array, axis: int) -> jax.Array:
  """Packs 4-bit codes in uint8 pairwise along `axis`: element 2i low nibble, 2i+1 high."""
  axis = axis % n.ndim
  if axis != n.ndim - 1:
    return jnp.moveaxis(pack_nibbles(jnp.moveaxis(n, axis, -1), -1), -1, axis)
  # lo + 16 hi as a weighted sum over the pair axis: Pallas' Triton lowering has no `slice`
  # to take the pair apart (a Pallas kernel cannot capture a constant array either: iota).
  pairs = n.reshape(n.shape[:-1] + (n.shape[-1] // 2, 2)).astype(jnp.int32)
  shift = 4 * lax.broadcasted_iota(jnp.int32, pairs.shape, pairs.ndim - 1)
  return jnp.sum(pairs << shift, axis=-1).astype(jnp.uint8)


def unpack_nibbles(p: jax.Array, axis: int) -> jax.Array:
  """Inverse of `pack_nibbles`: uint8 [..., L/2, ...] -> 4-bit codes in uint8 [..., L, ...]."""
  axis = axis % p.ndim
  if axis != p.ndim - 1:
    # Interleave along the last axis only (all Pallas' Triton lowering can stack along).
    return jnp.moveaxis(unpack_nibbles(jnp.moveaxis(p, axis, -1), -1), -1, axis)
  both = jnp.stack([p & 0xF, p >> 4], axis=-1)
  return both.reshape(p.shape[:-1] + (p.shape[-1] * 2,))


def compute_scale(amax: jax.Array, fmt: Format, scale_dtype: str) -> tuple[jax.Array, jax.Array]:
  """Absmax scale of a group: returns (raw stored scale, its exact float32 value).

  bf16 and e8m0 scales are rounded *up* from amax / max, so the group's largest
  element never exceeds the grid (no clipping error from the scale's rounding).
  e8m0 (MXFP4's power-of-two scale) is its uint8 exponent byte, which is also
  float32's biased exponent of the scale.
  """
  s = amax.astype(jnp.float32) / fmt.max
  s = jnp.maximum(jnp.where(amax > 0, s, 1.0), _MIN_SCALE)
  if scale_dtype == "fp32":
    return s, s
  bits = lax.bitcast_convert_type(s, jnp.uint32)
  if scale_dtype == "bf16":
    up = lax.bitcast_convert_type((bits + np.uint32(0xFFFF)) & np.uint32(0xFFFF0000), jnp.float32)
    return up.astype(jnp.bfloat16), up
  if scale_dtype == "e8m0":
    expo = (bits >> 23) + ((bits & np.uint32(0x7FFFFF)) != 0).astype(jnp.uint32)
    return expo.astype(jnp.uint8), lax.bitcast_convert_type(expo << 23, jnp.float32)
  raise ValueError(f"unknown scale dtype {scale_dtype!r}; valid: {sorted(SCALE_DTYPES)}")


def decode_scale(raw: jax.Array, scale_dtype: str) -> jax.Array:
  """Stored scale (uint8 exponent byte for e8m0; byte 0 reads as 0) -> float32."""
  if scale_dtype == "e8m0":
    return lax.bitcast_convert_type(raw.astype(jnp.uint32) << 23, jnp.float32)
  return raw.astype(jnp.float32)


def padded_length(length: int, block: int | None, packed: bool) -> int:
  """Length of the quantized axis once zero-padded to whole blocks (and to even for packing)."""
  if block is not None:
    length = -(-length // block) * block
  if packed and length % 2:
    length += 1
  return length


def stored_length(length: int, fmt: Format, block: int | None) -> int:
  """Length of the stored values along the quantized axis (half the padded length if packed)."""
  lp = padded_length(length, block, fmt.packed)
  return lp // 2 if fmt.packed else lp


def n_blocks(length: int, block: int | None) -> int:
  return 1 if block is None else -(-length // block)


def pad_axis(x: jax.Array, axis: int, length: int, value=0) -> jax.Array:
  axis = axis % x.ndim
  extra = length - x.shape[axis]
  if extra == 0:
    return x
  pads = [(0, 0)] * x.ndim
  pads[axis] = (0, extra)
  return jnp.pad(x, pads, constant_values=value)


def _split(shape: tuple[int, ...], axis: int, nb: int) -> tuple[int, ...]:
  return shape[:axis] + (nb, shape[axis] // nb) + shape[axis + 1:]


def quantize_core(x: jax.Array, fmt: Format, axis: int, block: int | None, scale_dtype: str
                  ) -> tuple[jax.Array, jax.Array]:
  """Quantizes `x` whose `axis` is already padded (see `padded_length`).

  One absmax scale per `block` consecutive elements along `axis` (block=None: one
  per whole axis). Returns (codes, raw scales) with the scales' `axis` of length
  n_blocks. Shared verbatim by the reference and the Pallas kernel bodies.
  """
  axis = axis % x.ndim
  x = x.astype(jnp.float32)
  nb = 1 if block is None else x.shape[axis] // block
  xb = x.reshape(_split(x.shape, axis, nb))
  amax = jnp.max(jnp.abs(xb), axis=axis + 1, keepdims=True)
  raw, s = compute_scale(amax, fmt, scale_dtype)
  codes = encode(round_to_grid(xb / s, fmt), fmt).reshape(x.shape)
  if fmt.packed:
    codes = pack_nibbles(codes, axis)
  return codes, jnp.squeeze(raw, axis + 1)


def dequantize_core(codes: jax.Array, raw_scales: jax.Array, fmt: Format, axis: int,
                    scale_dtype: str, dtype=jnp.float32) -> jax.Array:
  """Inverse of `quantize_core` (padded length along `axis`), cast to `dtype`."""
  axis = axis % codes.ndim
  if fmt.packed:
    codes = unpack_nibbles(codes, axis)
  v = decode(codes, fmt)
  nb = raw_scales.shape[axis]
  s = jnp.expand_dims(decode_scale(raw_scales, scale_dtype), axis + 1)
  return (v.reshape(_split(v.shape, axis, nb)) * s).reshape(v.shape).astype(dtype)


def quantize_ref(x: jax.Array, fmt: Format | str, axis: int = -1, block: int | None = None,
                 scale_dtype: str = "fp32") -> tuple[jax.Array, jax.Array]:
  """Reference quantization of `x` along `axis` (pure jnp).

  Returns (values, scales): values are the stored codes (int8 / float8 dtype, or
  uint8 with two 4-bit codes per byte) of the zero-padded axis; scales have
  n_blocks(length, block) entries along `axis` and the dtype of `scale_dtype`
  (float32, bfloat16, or uint8 e8m0 exponent bytes).
  """
  fmt = get_format(fmt) if isinstance(fmt, str) else fmt
  axis = axis % x.ndim
  lp = padded_length(x.shape[axis], block, fmt.packed)
  codes, raw = quantize_core(pad_axis(x, axis, lp), fmt, axis, block, scale_dtype)
  return codes, raw


def dequantize_ref(values: jax.Array, scales: jax.Array, fmt: Format | str, axis: int,
                   length: int, scale_dtype: str = "fp32", dtype=jnp.float32) -> jax.Array:
  """Reference dequantization; `length` is the logical (unpadded) size of `axis`."""
  fmt = get_format(fmt) if isinstance(fmt, str) else fmt
  axis = axis % values.ndim
  out = dequantize_core(values, scales, fmt, axis, scale_dtype, dtype)
  return lax.slice_in_dim(out, 0, length, axis=axis)


def grid_values(fmt: Format | str) -> np.ndarray:
  """Every finite grid value symmetric scaling can emit, as float32 (from ml_dtypes)."""
  fmt = get_format(fmt) if isinstance(fmt, str) else fmt
  if fmt.kind == "int":
    info = ml_dtypes.iinfo(fmt.grid_dtype)
    vals = np.arange(info.min, info.max + 1, dtype=np.float32)
    return vals[np.abs(vals) <= fmt.max]
  if fmt.kind == "float":
    n = 2**fmt.bits
    vals = np.arange(n, dtype=np.uint8).view(fmt.grid_dtype).astype(np.float32)
    return vals[np.isfinite(vals)]
  raise ValueError(f"format {fmt.name} has no finite grid to enumerate")


def error_bound(x: np.ndarray, scale: np.ndarray, fmt: Format) -> np.ndarray:
  """Worst-case |dequantize(quantize(x)) - x| for x inside the scaled range.

  int:   s/2 (round to nearest integer) + 2**-23 * max * s for the float32
         division and product.
  float: max(2**-(m+1) |x|, 2**(emin-m-1) s): half a grid spacing, relative in
         the normal range and absolute in the subnormal range, + 2**-22 |x| for
         float32 rounding of x/s and q*s.
  """
  x = np.abs(np.asarray(x, np.float64))
  scale = np.asarray(scale, np.float64)
  if fmt.kind == "int":
    return scale * (0.5 + 2.0**-23 * fmt.max)
  m = fmt.mantissa_bits
  return np.maximum(2.0**-(m + 1) * x, 2.0**(fmt.emin - m - 1) * scale) + 2.0**-22 * x

