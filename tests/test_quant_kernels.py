"""Pallas kernels (interpret mode) vs the jnp references: bit-exact codecs, matmul tolerance."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax.config_utils import ConfigError
from rl_jax.quant import formats as F
from rl_jax.ops import quant_kernels as K
from rl_jax.ops import kv_quant as qkv
from rl_jax.ops import quantized as ops
from rl_jax.quant.config import ActivationSpec, KVSpec, WeightSpec


def _same_bits(a, b):
  a, b = np.asarray(a), np.asarray(b)
  assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
  np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


# One case per format, each with a different granularity / scale dtype, and
# shapes that are not multiples of the tiles (M=13 rows, N=20 columns with
# 8-wide tiles), nor of the block (K=40 with block 16: a partial last block),
# nor even (K=37 per channel: 4-bit packing pads a zero).
CODEC_CASES = [
    ("int8", None, "fp32", 37),
    ("int4", 16, "bf16", 40),
    ("fp8", 16, "e8m0", 40),
    ("fp8_e5m2", None, "bf16", 40),
    ("fp4", 16, "e8m0", 37),
]


@functools.partial(jax.jit, static_argnames=("fmt", "block", "sd", "pow2"))
def _codecs(x_MK, w_GKN, fmt, block, sd, pow2=False):
  """Kernel and reference quantize + dequantize, along rows (x) and columns (w)."""
  k = x_MK.shape[1]
  kw = dict(interpret=True, pow2=pow2)
  rc, rs = K.quantize_rows(x_MK, fmt, block, sd, tm=8, **kw)
  cc, cs = K.quantize_cols(w_GKN, fmt, block, sd, tn=8, **kw)
  kernel = (rc, rs, K.dequantize_rows(rc, rs, fmt, block, sd, k, jnp.float32, tm=8, **kw),
            cc, cs, K.dequantize_cols(cc, cs, fmt, block, sd, k, jnp.bfloat16, tn=8, **kw))
  rrc, rrs = F.quantize_ref(x_MK, fmt, 1, block, sd)
  rcc, rcs = F.quantize_ref(w_GKN, fmt, 1, block, sd)
  ref = (rrc, rrs, F.dequantize_ref(rrc, rrs, fmt, 1, k, sd), rcc, rcs,
         F.dequantize_ref(rcc, rcs, fmt, 1, k, sd, jnp.bfloat16))
  return kernel, ref


@pytest.mark.parametrize("name,block,sd,k", CODEC_CASES)
def test_codec_kernels_match_reference_bit_for_bit(name, block, sd, k):
  """quantize / dequantize kernels (rows: activations & KV; columns: weights) == jnp reference."""
  fmt = F.get_format(name)
  rng = np.random.default_rng(0)
  x = (rng.standard_normal((13, k)) * np.exp(rng.uniform(-4, 4, (13, 1)))).astype(np.float32)
  x[3] = 0.0
  w = rng.standard_normal((2, k, 20)).astype(np.float32)
  kernel, ref = _codecs(jnp.asarray(x), jnp.asarray(w), fmt, block, sd)
  for a, b in zip(kernel, ref):
    _same_bits(a, b)


def test_power_of_two_tiles_give_the_same_result():
  """The GPU (Triton) layout pads blocks to powers of two; the stored result must not change."""
  fmt = F.get_format("fp4")
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((5, 48)).astype(np.float32))
  w = jnp.asarray(rng.standard_normal((1, 48, 12)).astype(np.float32))
  kernel, ref = _codecs(x, w, fmt, 16, "e8m0", pow2=True)
  for a, b in zip(kernel, ref):
    _same_bits(a, b)


def _assert_matmul_close(out, xd, wd):
  """|out - xd @ wd| <= 4 K 2**-24 (|xd| @ |wd|): float32 accumulation of K terms + scaling."""
  k = xd.shape[1]
  bound = 4 * k * 2.0**-24 * (np.abs(xd) @ np.abs(wd))
  err = np.abs(np.asarray(out, np.float64) - xd @ wd)
  assert np.all(err <= bound), float(np.max(err / np.maximum(bound, 1e-30)))


# (weights, activations or None, GPU power-of-two tiles): W8A8, W8A8 fp8, W4A16 block,
# MXFP4 W4A4, W8 fp8-e5m2 with block-wise int8 activations.
MATMUL_CASES = [
    (WeightSpec("int8"), ActivationSpec("int8"), False),
    (WeightSpec("fp8"), ActivationSpec("fp8"), False),
    (WeightSpec("int4", "block", 16), None, False),
    (WeightSpec("fp4"), ActivationSpec("fp4"), False),
    (WeightSpec("fp8_e5m2", "block", 32), ActivationSpec("int8", "block", 16), True),
]


def _kernel_programs(name, block, sd, k):
  """Each codec kernel and a qmatmul on this format, in the GPU layout (pow2, compiled)."""
  fmt = F.get_format(name)
  kw = dict(interpret=False, pow2=True)
  x = jax.ShapeDtypeStruct((40, k), jnp.float32)
  w = jax.ShapeDtypeStruct((2, k, 48), jnp.float32)
  deq_r = lambda x: K.dequantize_rows(*F.quantize_ref(x, fmt, 1, block, sd), fmt, block, sd, k,
                                      jnp.float32, **kw)
  deq_c = lambda w: K.dequantize_cols(*F.quantize_ref(w, fmt, 1, block, sd), fmt, block, sd, k,
                                      jnp.bfloat16, **kw)

  def mm(x, w):
    codes, scales = F.quantize_ref(w[0], fmt, 0, block, sd)
    return K.qmatmul(x, codes, scales, k=k, w_fmt=fmt, w_block=block, w_sd=sd, **kw)
  return {"quantize_rows": (lambda x: K.quantize_rows(x, fmt, block, sd, **kw), (x,)),
          "dequantize_rows": (deq_r, (x,)),
          "quantize_cols": (lambda w: K.quantize_cols(w, fmt, block, sd, **kw), (w,)),
          "dequantize_cols": (deq_c, (w,)), "qmatmul": (mm, (x, w))}


def _kernel_eqns(jaxpr, inside=False):
  """(primitive name, output dtypes) of every equation inside a pallas_call body, recursively."""
  for eqn in jaxpr.eqns:
    here = inside or eqn.primitive.name == "pallas_call"
    if inside:
      yield eqn.primitive.name, [v.aval.dtype for v in eqn.outvars]
    for val in eqn.params.values():
      for sub in (val if isinstance(val, (tuple, list)) else (val,)):
        sub = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
        if hasattr(sub, "eqns"):
          yield from _kernel_eqns(sub, here)


@pytest.mark.parametrize("name,block,sd,k", CODEC_CASES)
def test_kernels_lower_for_triton_with_its_semantics(name, block, sd, k):
  """Every kernel body lowers to Triton for a CUDA GPU, and uses no float `neg`.

  Found on an H200: Pallas' Triton lowering has no `round`, `slice` or inner-axis `stack`
  (the kernels failed to lower), and negates as `0 - x`, so -0.0 became +0.0 and ~6% of
  the fp4 codes (those rounding to zero) differed from the reference. Interpret mode
  follows XLA and cannot show the latter, hence the jaxpr check.
  """
  programs = _kernel_programs(name, block, sd, k)
  for op, (fn, args) in programs.items():
    negs = [dt for prim, dts in _kernel_eqns(jax.make_jaxpr(fn)(*args).jaxpr) if prim == "neg"
            for dt in dts if jnp.issubdtype(dt, jnp.floating)]
    assert not negs, f"{op}: float neg inside the kernel ({negs})"
  # Triton runs the grid's programs in parallel: no grid axis may revisit an output tile (a K
  # axis accumulating `o_ref[...] +=` races there). Each grid is as deep as the output's tiling.
  fn, args = programs["qmatmul"]
  [call] = [e for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns if e.primitive.name == "pallas_call"]
  assert len(call.params["grid_mapping"].grid) == 2, call.params["grid_mapping"].grid
  for op, (fn, args) in programs.items():
    try:
      text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    except RuntimeError as exc:
      if "No supported GPU devices" in str(exc):
        pytest.skip(f"jax {jax.__version__} lowers for CUDA only where a GPU is present")
      raise
    assert "xla.gpu.triton" in text and "mosaic_gpu" not in text, op


@pytest.mark.parametrize("wspec,aspec,pow2", MATMUL_CASES)
def test_qmatmul_kernel_equals_matmul_of_dequantized_operands(wspec, aspec, pow2):
  """Tiled kernel (3 K-steps, ragged M and N) vs float64 matmul of the dequantized operands."""
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.standard_normal((13, 96)).astype(np.float32))
  w = jnp.asarray(rng.standard_normal((96, 20)).astype(np.float32))

  @jax.jit
  def run(x, w):
    qt = ops.quantize_weight(w, wspec, act=aspec, backend="xla")
    # The operands the quantized matmul must reproduce: dequant(quant(.)).
    xd, wd = ops.fake_quantize_activations(x, qt), ops.dequantize_weight(qt, jnp.float32)
    w_scales = qt.scales
    common = dict(k=96, w_fmt=qt.fmt, w_block=qt.block_size, w_sd=qt.scale_dtype, tm=8, tn=8,
                  tk=32, pow2=pow2, interpret=True)
    if qt.act_format is None:
      out = K.qmatmul(x, qt.values, w_scales, **common)
    else:
      afmt = F.get_format(qt.act_format)
      codes, raw = K.quantize_rows(x, afmt, qt.act_block_size, qt.act_scale_dtype, tm=8,
                                   interpret=True)
      out = K.qmatmul(codes, qt.values, w_scales, x_scales=raw, a_fmt=afmt,
                      a_block=qt.act_block_size, a_sd=qt.act_scale_dtype, **common)
    return out, ops.qmatmul(x, qt), xd, wd

  out, out_xla, xd, wd = run(x, w)
  xd, wd = np.asarray(xd, np.float64), np.asarray(wd, np.float64)
  _assert_matmul_close(out, xd, wd)
  # The XLA path is that float matmul (float32, HIGHEST precision).
  _assert_matmul_close(out_xla, xd, wd)


def test_qtensor_pallas_backend_bf16_activations():
  """ops.qmatmul with backend='pallas' (bf16 x, leading dims) matches the XLA backend."""
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.standard_normal((2, 3, 64)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((64, 24)).astype(np.float32))

  @jax.jit
  def run(x, w):
    qt_p = ops.quantize_weight(w, WeightSpec("int8"), backend="pallas")
    qt_x = ops.quantize_weight(w, WeightSpec("int8"), backend="xla")
    return qt_p, qt_x, ops.qmatmul(x, qt_p), ops.dequantize_weight(qt_x, jnp.float32)

  qt_p, qt_x, out, wd = run(x, w)
  _same_bits(qt_p.values, qt_x.values)
  _same_bits(qt_p.scales, qt_x.scales)
  assert out.shape == (2, 3, 24) and out.dtype == jnp.bfloat16
  xd = np.asarray(x, np.float64).reshape(6, 64)
  wd = np.asarray(wd, np.float64)
  ref = xd @ wd
  # Only the final cast to bf16 differs from the exact product: <= 2**-8 relative + accumulation.
  bound = 2.0**-8 * np.abs(ref) + 4 * 64 * 2.0**-24 * (np.abs(xd) @ np.abs(wd))
  assert np.all(np.abs(np.asarray(out, np.float64).reshape(6, 24) - ref) <= bound)


@pytest.mark.parametrize("spec", [KVSpec("int4"), KVSpec("fp4", block_size=8),
                                  KVSpec("fp8", "block", 8)])
def test_kv_quantize_and_read_paths(spec):
  """kv_quantize / kv_dequantize: Pallas == XLA bit-for-bit, in the layout the cache stores."""
  rng = np.random.default_rng(4)
  x = jnp.asarray(rng.standard_normal((2, 3, 2, 16)), jnp.bfloat16)

  @jax.jit
  def run(x):
    out = {}
    for backend in ("pallas", "xla"):
      v, s = qkv.kv_quantize(x, spec, backend)
      out[backend] = (v, s, qkv.kv_dequantize(v, s, spec, jnp.float32, backend))
    return out

  out = run(x)
  for a, b in zip(out["pallas"], out["xla"]):
    _same_bits(a, b)
  v, s, _ = out["xla"]
  packed = F.get_format(spec.format).packed
  assert v.shape == (2, 3, 2, 8 if packed else 16)
  assert s.shape == (2, 3, 2, 16 // spec.block_size if spec.granularity == "block" else 1)


def test_kv_plain_formats_and_errors():
  x = jnp.ones((1, 2, 2, 6), jnp.float32)
  v, s = qkv.kv_quantize(x, KVSpec("bf16"))
  assert v.dtype == jnp.bfloat16 and s is None
  assert qkv.kv_dequantize(v, None, KVSpec("bf16"), jnp.float32).dtype == jnp.float32
  with pytest.raises(ConfigError, match="kv.block_size"):
    qkv.kv_quantize(x, KVSpec("int8", "block", 4))
  with pytest.raises(ConfigError, match="even"):
    qkv.kv_quantize(jnp.ones((1, 2, 2, 5)), KVSpec("int4"))


def test_backend_switch():
  # auto: the codecs are XLA's everywhere (faster on an H200); the qmatmul kernel off CPU.
  assert ops.resolve_backend("auto") == "xla"
  assert ops.resolve_backend("auto", "matmul") == ("xla" if jax.default_backend() == "cpu" else "pallas")
  assert ops.resolve_backend("pallas") == ops.resolve_backend("pallas", "matmul") == "pallas"
  with pytest.raises(ValueError, match="op"):
    ops.resolve_backend("auto", "conv")
  with pytest.raises(ConfigError, match="backend"):
    ops.resolve_backend("triton")
