"""Number formats against ml_dtypes: on-grid exactness, error bounds, saturation, sign, storage."""
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from rl_jax.quant import formats as F

QFORMATS = ["int8", "int4", "fp8", "fp8_e5m2", "fp4"]
FLOAT_FORMATS = ["fp8", "fp8_e5m2", "fp4"]


def _bits(a):
  return np.asarray(a, np.float32).view(np.uint32)


# Every roundtrip test uses this shape and these settings, computed by one
# jitted function per format, so each format compiles once.
SHAPE = (16, 256)
SETTINGS = [(None, "fp32"), (32, "bf16"), (32, "e8m0")]


@functools.partial(jax.jit, static_argnames=("fmt",))
def _roundtrips(x, fmt):
  """{"block/scale_dtype": (values, scales, dequantized x, float32 scale of each element)}."""
  out = {}
  for block, scale_dtype in SETTINGS:
    values, scales = F.quantize_ref(x, fmt, 1, block, scale_dtype)
    deq = F.dequantize_ref(values, scales, fmt, 1, x.shape[1], scale_dtype)
    s = F.decode_scale(scales, scale_dtype)
    s = jnp.repeat(s, x.shape[1] // s.shape[1], axis=1)
    out[f"{block}/{scale_dtype}"] = (values, scales, deq, s)
  return out


_round = jax.jit(F.round_to_grid, static_argnums=1)


@functools.partial(jax.jit, static_argnums=1)
def _codec(g, fmt):
  codes = F.encode(g, fmt)
  return F.round_to_grid(g, fmt), codes, F.decode(codes, fmt)


@pytest.mark.parametrize("name", QFORMATS)
def test_every_grid_value_is_a_fixed_point(name):
  """round_to_grid, encode -> decode are the identity (bit-exact, -0 included) on the whole grid."""
  fmt = F.get_format(name)
  grid = F.grid_values(fmt)
  if fmt.kind == "float":
    non_finite = {"fp8": 2, "fp8_e5m2": 8, "fp4": 0}[name]  # NaNs (+-inf for e5m2)
    assert len(grid) == 2**fmt.bits - non_finite
  else:
    assert len(grid) == 2 * fmt.max + 1  # symmetric: -128 / -8 are never emitted
  rounded, codes, decoded = _codec(jnp.asarray(grid), fmt)
  np.testing.assert_array_equal(_bits(rounded), _bits(grid))
  np.testing.assert_array_equal(_bits(decoded), _bits(grid))
  # Stored codes are the format's own bit patterns.
  truth = grid.astype(fmt.grid_dtype).view(np.uint8)
  mine = np.asarray(codes).view(np.uint8)
  if fmt.packed:
    truth = truth & 0xF
  np.testing.assert_array_equal(mine, truth)


@pytest.mark.parametrize("name", QFORMATS)
def test_on_grid_values_roundtrip_exactly(name):
  """quantize -> dequantize is exact for grid values times a power of two.

  Every block of 32 starts with +-max, so its scale is exactly the power of two
  (whatever the scale dtype) and every other entry is a grid value times it.
  """
  fmt = F.get_format(name)
  grid = F.grid_values(fmt)
  rows, cols = SHAPE
  x = np.resize(grid, rows * cols).reshape(rows, cols // 32, 32)
  x[:, :, 0] = np.where(np.arange(rows) % 2, 1.0, -1.0)[:, None] * fmt.max
  x = x.reshape(SHAPE) * np.float32(2.0) ** (np.arange(rows) % 9 - 4)[:, None]
  x = x.astype(np.float32)
  for setting, (_, _, out, _) in _roundtrips(jnp.asarray(x), name).items():
    np.testing.assert_array_equal(_bits(out), _bits(x), err_msg=str(setting))


def _adversarial(fmt):
  """Midpoints between grid neighbours, each +-1 float32 ulp, and the grid's neighbourhood."""
  g = np.unique(np.abs(F.grid_values(fmt)))
  mids = ((g[1:].astype(np.float64) + g[:-1]) / 2).astype(np.float32)
  pts = np.concatenate([mids, g, [fmt.max * 1.001, fmt.max * 7, np.finfo(np.float32).max]])
  pts = np.concatenate([pts, np.nextafter(pts, np.float32(np.inf)),
                        np.nextafter(pts, np.float32(0))]).astype(np.float32)
  return np.concatenate([pts, -pts])


def test_round_half_even_equals_rint_bitwise():
  """The Triton-lowerable rounding equals numpy's rint on every kind of float32: ties (odd and
  even), one ulp either side of them, signed zeros, the 2**23 boundary, infinities, NaN."""
  rng = np.random.default_rng(1)
  ties = np.arange(-40, 40, dtype=np.float32) + np.float32(0.5)
  near = np.concatenate([np.nextafter(ties, np.float32(np.inf)), np.nextafter(ties, -np.float32(np.inf))])
  big = np.float32(2.0**23) + np.array([-1.5, -0.5, 0, 1, 2], np.float32)
  y = np.concatenate([
      rng.standard_normal(20000).astype(np.float32) * np.exp(rng.uniform(-20, 30, 20000)).astype(np.float32),
      ties, near, big, -big, [0.0, -0.0, 0.3, -0.3, 0.5, -0.5, np.inf, -np.inf, np.nan]]).astype(np.float32)
  got = np.asarray(jax.jit(F.round_half_even)(jnp.asarray(y)))
  np.testing.assert_array_equal(_bits(got), _bits(np.rint(y)))


@pytest.mark.parametrize("name", QFORMATS)
def test_rounding_matches_ml_dtypes(name):
  """Round-to-nearest-even with saturation equals ml_dtypes' cast of the clipped value, bit for bit.

  Inputs: random magnitudes over 2**+-17, every midpoint of the grid +-1 ulp, and
  values past the grid (max * 1.001, max * 7, float32 max, inf) that saturate.
  """
  fmt = F.get_format(name)
  rng = np.random.default_rng(0)
  rand = (rng.standard_normal(20000) * np.exp(rng.uniform(-12, 12, 20000))).astype(np.float32)
  y = np.concatenate([rand, _adversarial(fmt), [0.0, -0.0, np.inf, -np.inf]]).astype(np.float32)
  mine = np.asarray(_round(jnp.asarray(y), fmt))
  assert np.all(np.abs(mine[np.abs(y) >= fmt.max]) == fmt.max)
  clipped = np.clip(y, -fmt.max, fmt.max)
  if fmt.kind == "int":
    truth = np.rint(clipped)  # numpy rounds half to even
  else:
    truth = clipped.astype(fmt.grid_dtype).astype(np.float32)
  np.testing.assert_array_equal(_bits(mine), _bits(truth))


def test_no_double_rounding_through_16_bits():
  """The known pitfall: a cast via bf16/f16 rounds twice. These inputs would catch it."""
  fmt = F.get_format("fp4")
  # Just above a midpoint whose lower neighbour is even: one rounding goes up,
  # rounding to 16 bits first lands on the tie and then goes down to even.
  y = np.array([0.25 + 2**-20, 1.25 + 2**-12, 2.5 + 2**-12, 5.0 + 2**-10, -(1.25 + 2**-12)],
               np.float32)
  truth = y.astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
  twice = y.astype(ml_dtypes.bfloat16).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
  assert np.all(truth != twice)
  np.testing.assert_array_equal(np.asarray(_round(jnp.asarray(y), fmt)), truth)


@pytest.mark.parametrize("name", QFORMATS)
def test_random_error_within_theory(name):
  """|dequant(quant(x)) - x| <= formats.error_bound, with s the stored scale:

  int8 / int4: s/2 (+ float32 slack 2**-23 * max * s);
  fp8 (e4m3, m=3, emin=-6): 2**-4 |x| normal, 2**-10 s subnormal;
  fp8_e5m2 (m=2, emin=-14): 2**-3 |x|, 2**-17 s;  fp4 (e2m1, m=1, emin=0): 2**-2 |x|, 2**-2 s;
  each + 2**-22 |x| for the float32 division and product. The bound is also tight
  (the worst element reaches at least 40% of it), so it is not vacuous.
  """
  fmt = F.get_format(name)
  rng = np.random.default_rng(1)
  x = rng.standard_normal(SHAPE) * np.exp(rng.uniform(-3, 3, (SHAPE[0], 1)))
  x = x.astype(np.float32)
  for setting, (_, _, out, s) in _roundtrips(jnp.asarray(x), name).items():
    err = np.abs(np.asarray(out, np.float64) - x)
    bound = F.error_bound(x, np.asarray(s), fmt)
    assert np.all(err <= bound), setting
    assert np.max(err / bound) > 0.4, setting


@pytest.mark.parametrize("name", QFORMATS)
def test_saturation_at_format_max(name):
  """A group's absmax element lands on the +-max code (beyond-grid values: rounding test)."""
  fmt = F.get_format(name)
  x = np.random.default_rng(2).standard_normal(SHAPE).astype(np.float32)
  values, _, _, _ = _roundtrips(jnp.asarray(x), name)["None/fp32"]
  decoded = np.asarray(jax.jit(lambda v: F.decode(F.unpack_nibbles(v, 1) if fmt.packed else v,
                                                  fmt))(values))
  rows = np.arange(SHAPE[0])
  i = np.argmax(np.abs(x), axis=1)
  np.testing.assert_array_equal(decoded[rows, i], np.sign(x[rows, i]) * fmt.max)


@pytest.mark.parametrize("name", QFORMATS)
def test_zeros_and_signs_preserved(name):
  """All-zero groups stay 0; -0.0 keeps its sign bit in float formats; no value changes sign."""
  fmt = F.get_format(name)
  rng = np.random.default_rng(3)
  x = rng.standard_normal(SHAPE).astype(np.float32)
  x[1] = 0.0
  x[2, ::3] = -0.0
  _, _, out, _ = _roundtrips(jnp.asarray(x), name)["None/fp32"]
  out = np.asarray(out)
  np.testing.assert_array_equal(out[1], 0.0)
  assert np.all((np.sign(out) == np.sign(x)) | (out == 0))
  if fmt.kind == "float":
    assert np.all(np.signbit(out[2, ::3]))


@pytest.mark.parametrize("scale_dtype", ["bf16", "e8m0"])
def test_low_precision_scales_round_up(scale_dtype):
  """bf16 / e8m0 scales are >= amax / max (no clipping), e8m0 a power of two, bf16 within 2**-7."""
  amax = jnp.asarray(np.random.default_rng(4).uniform(1e-6, 1e6, 1000).astype(np.float32))
  fmt = F.get_format("fp8")
  raw, s, decoded = jax.jit(lambda a: (
      *F.compute_scale(a, fmt, scale_dtype),
      F.decode_scale(F.compute_scale(a, fmt, scale_dtype)[0], scale_dtype)))(amax)
  exact = np.asarray(amax, np.float64) / fmt.max
  s = np.asarray(s, np.float64)
  assert np.all(s >= exact)
  np.testing.assert_array_equal(np.asarray(decoded), s)
  if scale_dtype == "e8m0":
    assert np.all(s < 2 * exact) and np.all(np.log2(s) == np.round(np.log2(s)))
    # The stored byte is an e8m0 value, bit for bit.
    stored = np.asarray(raw)
    assert stored.dtype == np.uint8
    np.testing.assert_array_equal(stored.view(ml_dtypes.float8_e8m0fnu).astype(np.float64), s)
  else:
    assert np.all(s <= exact * (1 + 2**-7))


@pytest.mark.parametrize("axis", [0, 1])
def test_packing_two_codes_per_byte(axis):
  """pack/unpack are inverse along either axis; element 2i is the low nibble, 2i+1 the high one."""
  n = np.random.default_rng(5).integers(0, 16, (6, 10)).astype(np.uint8)
  p, back = jax.jit(lambda n: (F.pack_nibbles(n, axis), F.unpack_nibbles(F.pack_nibbles(n, axis),
                                                                          axis)))(n)
  assert p.dtype == jnp.uint8 and p.shape[axis] == n.shape[axis] // 2
  np.testing.assert_array_equal(np.asarray(back), n)
  first, second = np.take(n, 0, axis), np.take(n, 1, axis)
  np.testing.assert_array_equal(np.take(np.asarray(p), 0, axis), first | (second << 4))


@pytest.mark.parametrize("name,dtype,bytes_per_value", [
    ("int8", jnp.int8, 1.0), ("fp8", jnp.float8_e4m3fn, 1.0), ("fp8_e5m2", jnp.float8_e5m2, 1.0),
    ("int4", jnp.uint8, 0.5), ("fp4", jnp.uint8, 0.5)])
def test_real_low_bit_storage(name, dtype, bytes_per_value):
  """Stored values have the low-bit dtype; 4-bit formats take half a byte per value (packed)."""
  x = jax.ShapeDtypeStruct((64, 40), jnp.bfloat16)
  values, scales = jax.eval_shape(lambda a: F.quantize_ref(a, name, axis=1, block=None), x)
  assert values.dtype == dtype
  assert values.size * jnp.dtype(values.dtype).itemsize == 64 * 40 * bytes_per_value
  assert scales.shape == (64, 1)
