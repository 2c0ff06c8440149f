"""The prepared accelerator check: every Pallas kernel compiled for the device vs its jnp reference, attention, zero mismatch, 10 RL steps."""
# Usage:
#   python benchmarks/device_check.py [--out DIR]       # on one H200: 327 s before the sampler
#                                                       # section existed (2026-12-04; that one is
#                                                       # ~6 compiles more, not yet timed on a GPU)
#   python benchmarks/device_check.py --small           # small sizes (seconds of work on CPU)
#   python benchmarks/device_check.py --small --sections quant,gmm,attention
#
# Prints ONE table (and writes device_check.md / device_check.json to --out): per row the
# name, status (ok / FAIL / skipped: reason), max error, tolerance, the median time of the
# checked program, the median time of its reference, and their ratio. Sections:
#   quant      rl_jax/quant/kernels.py: the four codecs (bit-exact vs formats.*_ref: the error
#              is the number of differing elements, tolerance 0) and qmatmul (vs the f32 HIGHEST
#              matmul of the dequantized operands, i.e. ops.qmatmul's xla path);
#   gmm        rl_jax/models/grouped_matmul.py impl="pallas" forward and forward+backward vs
#              lax.ragged_dot (errors vs ragged_dot on float32 inputs at HIGHEST precision;
#              times vs ragged_dot on the same inputs, which XLA:GPU expands densely), and the
#              MoE experts' forward+backward wired to it (model.expert_matmul="grouped") vs the slab;
#   attention  rl_jax.models.attention.attention(impl=flash / cudnn / splash) vs impl="xla"
#              (errors vs xla on float32 inputs at HIGHEST precision, times vs xla on the same
#              bf16 inputs); skipped with the module's reason where an impl cannot run;
#   sampler    the quantized sampler's decode loop, Pallas kernels (backend="pallas": qmatmul for
#              weights x activations, codecs for the KV cache) vs the same preset through XLA
#              (backend="xla"), greedy, one MoE model: tokens equal, log q equal to float32
#              summation order on each row's common prefix, generate time ratio;
#   rl         configs/countdown_tiny.py:test from random init: the fp32 sampler's log q vs the
#              trainer's p_old forward on the same tokens, then RLTrainer.run() for 10 steps.
# Matmul errors are elementwise relative to the product of absolute values (|x| @ |w| for
# y; the same for each gradient), so one tolerance covers every element: u_out (one rounding
# to the output dtype: 2**-8 for bf16, 0 for f32) + 2 K 2**-24 (two float32 sums of K terms,
# the checked one and the reference's); qmatmul, which also rounds its scales, takes the
# tests' 4 K 2**-24 for each program, 8 K 2**-24. Every row runs in its own try/except: a failure is
# recorded as its row and the others still run.
#
# Times: jit-compiled, one warm-up call, then the median of --runs calls, each ended by
# block_until_ready. On CPU there is no Pallas compiler: kernels run in interpret mode
# (an emulator) and sizes are always the small ones, so the figures only show that the
# check runs; the table header says so.
from __future__ import annotations

import argparse
import contextlib
import functools
import dataclasses
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

SECTIONS = ("lower", "quant", "gmm", "attention", "sampler", "rl")
_U32 = 2.0**-24
_UBF16 = 2.0**-8
_HIGHEST = jax.lax.Precision.HIGHEST


class Skip(Exception):
  """A row that cannot run here; the message is the reason."""


@dataclasses.dataclass
class Row:
  name: str
  status: str = "ok"
  err: float | None = None
  tol: float | None = None
  time_s: float | None = None
  ref_s: float | None = None
  note: str = ""

  @property
  def ratio(self) -> float | None:
    if self.time_s is None or not self.ref_s:
      return None
    return self.time_s / self.ref_s


@dataclasses.dataclass(frozen=True)
class Sizes:
  """Problem sizes: `full` for a GPU (a few seconds of device work per row), `small` for CPU."""
  codec_m: int
  codec_k: int
  codec_g: int
  codec_n: int
  mm_m: int
  mm_k: int
  mm_n: int
  gmm_m: int
  gmm_d: int
  gmm_f: int
  gmm_e: int
  att_b: int
  att_s: int
  att_g: int
  att_r: int
  att_d: int


FULL = Sizes(codec_m=4096, codec_k=4096, codec_g=4, codec_n=2048, mm_m=2048, mm_k=4096, mm_n=4096,
             gmm_m=16384, gmm_d=2048, gmm_f=768, gmm_e=64,  # Qwen3-30B-A3B's expert shapes, E/2
             att_b=4, att_s=2048, att_g=4, att_r=4, att_d=128)
SMALL = Sizes(codec_m=40, codec_k=96, codec_g=2, codec_n=40, mm_m=40, mm_k=96, mm_n=48,
              gmm_m=200, gmm_d=64, gmm_f=48, gmm_e=8,
              att_b=2, att_s=64, att_g=2, att_r=2, att_d=16)


# --- helpers ----------------------------------------------------------------------------


def _timed(fn, *args, runs: int) -> float:
  """Median wall seconds of `fn(*args)` after one warm-up (compile) call."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(runs):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def _mismatches(a, b) -> int:
  """Elements whose bytes differ (shapes and dtypes must agree)."""
  a, b = np.asarray(a), np.asarray(b)
  if a.shape != b.shape or a.dtype != b.dtype:
    raise AssertionError(f"shape/dtype {a.shape} {a.dtype} != {b.shape} {b.dtype}")
  if a.size == 0:
    return 0
  as_bytes = lambda c: np.ascontiguousarray(c).reshape(-1).view(np.uint8).reshape(c.size, -1)
  return int(np.sum(np.any(as_bytes(a) != as_bytes(b), axis=1)))


def _rel_err(out, ref, scale) -> jax.Array:
  """max |out - ref| / scale elementwise; where scale is 0 the difference must be 0 (else inf)."""
  diff = jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))
  scale = scale.astype(jnp.float32)
  per = jnp.where(scale > 0, diff / jnp.where(scale > 0, scale, 1.0), jnp.where(diff > 0, jnp.inf, 0.0))
  return jnp.max(per) if per.size else jnp.float32(0)


def _kernel_opts() -> dict:
  # As rl_jax.quant.ops: no Pallas compiler on CPU (interpret), Triton wants power-of-two blocks.
  platform = jax.default_backend()
  return dict(interpret=platform == "cpu", pow2=platform == "gpu")


# --- quant kernels --------------------------------------------------------------------------


# (format, block or None, scale dtype): per-channel int8, and MXFP4-like packed fp4 blocks.
CODEC_CASES = [("int8", None, "fp32"), ("fp4", 32, "e8m0")]


def _codec_rows(sz: Sizes, runs: int):
  from rl_jax.quant import formats as F
  from rl_jax.quant import kernels as K
  opts = _kernel_opts()
  rng = np.random.default_rng(0)
  # Rows of very different magnitudes (activations), one all-zero row (a padding token).
  x = rng.standard_normal((sz.codec_m, sz.codec_k)) * np.exp(rng.uniform(-4, 4, (sz.codec_m, 1)))
  x[1] = 0.0
  x = jnp.asarray(x, jnp.float32)
  w = jnp.asarray(rng.standard_normal((sz.codec_g, sz.codec_k, sz.codec_n)), jnp.float32)
  k = sz.codec_k
  def exact(kern, ref, make_args):
    """A codec kernel against its reference: every output element equal (tolerance 0)."""
    args = make_args()
    outs = lambda f: (lambda o: o if isinstance(o, tuple) else (o,))(f(*args))
    err = sum(_mismatches(a, b) for a, b in zip(outs(kern), outs(ref)))
    return dict(err=err, tol=0, time_s=_timed(kern, *args, runs=runs), ref_s=_timed(ref, *args, runs=runs))

  for name, block, sd in CODEC_CASES:
    fmt = F.get_format(name)
    tag = f"{name}" + (f"/{block}" if block else "") + f" {sd}"
    # Row-wise codecs on x (dequantized to f32), column-wise on w (to bf16). Every value is bound now
    # (default arguments, functools.partial), not read from the loop when run_checks calls the row.
    for axis, a, out in (("rows", x, jnp.float32), ("cols", w, jnp.bfloat16)):
      quant_k, dequant_k = getattr(K, f"quantize_{axis}"), getattr(K, f"dequantize_{axis}")
      ref_q = lambda v, fmt=fmt, block=block, sd=sd: F.quantize_ref(v, fmt, 1, block, sd)
      cases = {
          f"quantize_{axis}": (lambda v, q=quant_k, fmt=fmt, block=block, sd=sd: q(v, fmt, block, sd, **opts),
                               ref_q, lambda a=a: (a,)),
          f"dequantize_{axis}": (
              lambda c, s, d=dequant_k, fmt=fmt, block=block, sd=sd, out=out: d(c, s, fmt, block, sd, k, out, **opts),
              lambda c, s, fmt=fmt, sd=sd, out=out: F.dequantize_ref(c, s, fmt, 1, k, sd, out),
              lambda a=a, ref_q=ref_q: ref_q(a)),
      }
      for op, (kern, ref, make_args) in cases.items():
        yield f"quant {op} {tag}", functools.partial(exact, jax.jit(kern), jax.jit(ref), make_args)


def _qmatmul_rows(sz: Sizes, runs: int):
  from rl_jax.quant import formats as F
  from rl_jax.quant import kernels as K
  from rl_jax.quant import ops
  from rl_jax.quant.config import ActivationSpec, WeightSpec
  cases = [("W8A8 int8", WeightSpec("int8"), ActivationSpec("int8")),
           ("W8A8 fp8", WeightSpec("fp8"), ActivationSpec("fp8")),
           ("W4A16 int4/32", WeightSpec("int4", "block", 32), None),
           ("W4A4 fp4", WeightSpec("fp4"), ActivationSpec("fp4"))]
  opts = _kernel_opts()
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((sz.mm_m, sz.mm_k)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((sz.mm_k, sz.mm_n)), jnp.float32)
  k = sz.mm_k
  for label, wspec, aspec in cases:
    def row(wspec=wspec, aspec=aspec):
      qt = jax.jit(lambda w: ops.quantize_weight(w, wspec, act=aspec, backend="xla"))(w)
      common = dict(k=k, w_fmt=qt.fmt, w_block=qt.block_size, w_sd=qt.scale_dtype, **opts)

      @jax.jit
      def kern(x, qt):
        if qt.act_format is None:
          return K.qmatmul(x, qt.values, qt.scales, **common)
        afmt = F.get_format(qt.act_format)
        codes, raw = K.quantize_rows(x, afmt, qt.act_block_size, qt.act_scale_dtype, **opts)
        return K.qmatmul(codes, qt.values, qt.scales, x_scales=raw, a_fmt=afmt,
                         a_block=qt.act_block_size, a_sd=qt.act_scale_dtype, **common)

      ref = jax.jit(ops.qmatmul)  # xla backend: f32 HIGHEST matmul of the dequantized operands

      @jax.jit
      def error(out, ref_out, x, qt):
        xd, wd = ops.fake_quantize_activations(x, qt), ops.dequantize_weight(qt, jnp.float32)
        scale = jnp.dot(jnp.abs(xd), jnp.abs(wd), precision=_HIGHEST)
        return _rel_err(out, ref_out, scale)

      err = float(error(kern(x, qt), ref(x, qt), x, qt))
      # The tests' bound, 4 K 2**-24 (|x| @ |w|) vs float64, for each of the two programs.
      return dict(err=err, tol=8 * k * _U32, time_s=_timed(kern, x, qt, runs=runs),
                  ref_s=_timed(ref, x, qt, runs=runs), note="incl. activation quantize")
    yield f"quant qmatmul {label}", row


# --- grouped matmul -------------------------------------------------------------------------


def _gmm_rows(sz: Sizes, runs: int):
  from rl_jax.models import grouped_matmul as G
  m, d, f, e = sz.gmm_m, sz.gmm_d, sz.gmm_f, sz.gmm_e
  rng = np.random.default_rng(2)
  # Skewed loads with two empty experts (what a router produces), summing to M.
  p = rng.dirichlet(np.full(e, 0.5))
  p[[1, e // 2]] = 0.0
  gs = jnp.asarray(rng.multinomial(m, p / p.sum()), jnp.int32)
  backend = jax.default_backend()

  def check_backend():
    if backend == "tpu":
      raise Skip("the Triton-style kernel is for GPU (TPU: ragged_dot is native; megablox.gmm exists)")

  def inputs(dtype):
    return (jnp.asarray(rng.standard_normal((m, d)), dtype),
            jnp.asarray(rng.standard_normal((e, d, f)) / math.sqrt(d), dtype),
            jnp.asarray(rng.standard_normal((m, f)), dtype))

  def fwd(impl):
    return jax.jit(lambda x, w: G.grouped_matmul(x, w, gs, impl=impl))

  def fwd_bwd(impl):
    @jax.jit
    def f_(x, w, dy):
      y, vjp = jax.vjp(lambda x, w: G.grouped_matmul(x, w, gs, impl=impl), x, w)
      return (y, *vjp(dy))
    return f_

  @jax.jit
  def exact(x, w, dy):
    """(y, dx, dw) of ragged_dot on f32 at HIGHEST, and the same of (|x|, |w|, |dy|)."""
    def rd(x, w):
      return jax.lax.ragged_dot(x, w, gs, precision=_HIGHEST, preferred_element_type=jnp.float32)
    f32 = lambda a: a.astype(jnp.float32)
    y, vjp = jax.vjp(rd, f32(x), f32(w))
    ay, avjp = jax.vjp(rd, jnp.abs(f32(x)), jnp.abs(f32(w)))
    return (y, *vjp(f32(dy))), (ay, *avjp(jnp.abs(f32(dy))))

  def tol(dtype, ks):
    return (_UBF16 if dtype == jnp.bfloat16 else 0.0) + 2 * max(ks) * _U32

  def fwd_row(dtype):
    def row():
      check_backend()
      x, w, _ = inputs(dtype)
      (y, _, _), (ay, _, _) = exact(x, w, jnp.zeros((m, f), dtype))
      kern, ref = fwd("pallas"), fwd("ragged_dot")
      err = float(_rel_err(kern(x, w), y, ay))
      return dict(err=err, tol=tol(dtype, [d]), time_s=_timed(kern, x, w, runs=runs),
                  ref_s=_timed(ref, x, w, runs=runs))
    return row

  def fwd_bwd_row(dtype):
    def row():
      check_backend()
      x, w, dy = inputs(dtype)
      want, scale = exact(x, w, dy)
      kern, ref = fwd_bwd("pallas"), fwd_bwd("ragged_dot")
      got = kern(x, w, dy)
      errs = [float(_rel_err(g, r, s)) for g, r, s in zip(got, want, scale)]
      return dict(err=max(errs), tol=tol(dtype, [d, f, m]), time_s=_timed(kern, x, w, dy, runs=runs),
                  ref_s=_timed(ref, x, w, dy, runs=runs),
                  note="max of y/dx/dw " + "/".join(f"{v:.1e}" for v in errs))
    return row

  def moe_row():
    """The wired path: the MoE experts' forward + backward under model.expert_matmul="grouped"
    (moe.dropless_experts, compiled) vs the slab, on float32 inputs (the rounding bound of
    tests/tolerances.py is not reproduced here: relative to the largest |y| / gradient entry)."""
    check_backend()
    from rl_jax.models import moe
    n, k = m // 2, 2
    ids = jnp.asarray(np.stack([rng.choice(e, k, replace=False, p=p / p.sum()) for _ in range(n)]), jnp.int32)
    gates = jnp.full((n, k), 0.5, jnp.float32)
    x = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
    ws = tuple(jnp.asarray(rng.standard_normal(s) / math.sqrt(s[1]), jnp.float32)
               for s in ((e, d, f), (e, d, f), (e, f, d)))

    def program(matmul):
      loss = lambda x, *w: jnp.sum(moe.dropless_experts(x, ids, gates, *w, e, matmul=matmul) ** 2)
      return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))

    kern, ref = program("grouped"), program("slab")
    (_, got), (_, want) = kern(x, *ws), ref(x, *ws)
    err = max(float(jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-30))
              for a, b in zip(got, want))
    # Sums of up to D + F + M k terms (dw), float32, both programs.
    return dict(err=err, tol=2 * (d + f + n * k) * _U32, time_s=_timed(kern, x, *ws, runs=runs),
                ref_s=_timed(ref, x, *ws, runs=runs), note="grads x/w_gate/w_up/w_down vs slab")

  shape = f"M={m} D={d} F={f} E={e}"
  yield f"gmm pallas fwd bf16 {shape}", fwd_row(jnp.bfloat16)
  yield f"gmm pallas fwd+bwd bf16 {shape}", fwd_bwd_row(jnp.bfloat16)
  yield f"gmm pallas fwd+bwd f32 {shape}", fwd_bwd_row(jnp.float32)
  yield f"gmm moe expert_matmul=grouped fwd+bwd f32 vs slab N={m // 2} K=2 D={d} F={f} E={e}", moe_row


# --- attention ------------------------------------------------------------------------------


def _attention_rows(sz: Sizes, runs: int):
  b, s, g, r, d = sz.att_b, sz.att_s, sz.att_g, sz.att_r, sz.att_d
  rng = np.random.default_rng(3)
  q = rng.standard_normal((b, s, g, r, d), dtype=np.float32)
  k = rng.standard_normal((b, s, g, d), dtype=np.float32)
  v = rng.standard_normal((b, s, g, d), dtype=np.float32)
  cot = rng.standard_normal((b, s, g, r, d), dtype=np.float32)
  pad = rng.integers(0, s // 4 + 1, (b, 1))  # left padding, the trainer's layout
  valid = jnp.asarray(np.arange(s)[None] >= pad)
  bf = [jnp.asarray(a, jnp.bfloat16) for a in (q, k, v)]
  f32 = [jnp.asarray(a, jnp.float32) for a in bf]  # the same (bf16-rounded) values
  cot = jnp.asarray(cot)
  # Errors relative to max |v| (outputs) or max |reference gradient|: bf16 q / k / v, each
  # implementation rounding scores, probabilities and the output at ~2**-8 (scores of a few
  # units), hence 8 x 2**-8.
  att_tol = 8 * _UBF16

  try:
    from rl_jax.models import attention as A
  except ImportError as exc:
    for impl in ("flash", "cudnn", "splash"):
      def missing(exc=exc):
        raise Skip(f"rl_jax.models.attention missing ({exc})")
      yield f"attention {impl}", missing
    return

  def fwd(impl):
    return jax.jit(lambda q, k, v: A.attention(q, k, v, valid, impl=impl))

  def fwd_bwd(impl):
    def loss(q, k, v):
      out = A.attention(q, k, v, valid, impl=impl).astype(jnp.float32)
      # Only queries that see a key: a left-padding query's value is never read.
      return jnp.sum(jnp.where(valid[:, :, None, None, None], out * cot, 0.0))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))

  with jax.default_matmul_precision("highest"):
    ref_out = fwd("xla")(*f32)
    _, ref_grads = fwd_bwd("xla")(*f32)
  vmax = float(jnp.max(jnp.abs(f32[2])))
  valid_q = valid[:, :, None, None, None]

  def unsupported(impl):
    why = getattr(A, f"_{impl}_unsupported", None)
    if why is None:
      return None
    return why(bf[0], bf[1], bf[2], valid, 0, True, "bcgd")

  def rows(impl):
    def fwd_row():
      reason = unsupported(impl) if impl != "flash" else None
      if reason:
        raise Skip(reason)
      kern, ref = fwd(impl), fwd("xla")
      out = kern(*bf).astype(jnp.float32)
      err = float(jnp.max(jnp.where(valid_q, jnp.abs(out - ref_out), 0.0))) / vmax
      return dict(err=err, tol=att_tol, time_s=_timed(kern, *bf, runs=runs),
                  ref_s=_timed(ref, *bf, runs=runs), note="err / max abs(v); vs xla f32")

    def bwd_row():
      reason = unsupported(impl) if impl != "flash" else None
      if reason:
        raise Skip(reason)
      kern, ref = fwd_bwd(impl), fwd_bwd("xla")
      _, grads = kern(*bf)
      errs = [float(jnp.max(jnp.abs(gr.astype(jnp.float32) - rg)) / jnp.max(jnp.abs(rg)))
              for gr, rg in zip(grads, ref_grads)]
      return dict(err=max(errs), tol=att_tol, time_s=_timed(kern, *bf, runs=runs),
                  ref_s=_timed(ref, *bf, runs=runs),
                  note="dq/dk/dv err / max abs(ref grad) " + "/".join(f"{e_:.1e}" for e_ in errs))
    return fwd_row, bwd_row

  shape = f"B={b} S={s} G={g} R={r} D={d} bf16"
  for impl in ("flash", "cudnn", "splash"):
    fwd_row, bwd_row = rows(impl)
    yield f"attention {impl} fwd {shape}", fwd_row
    yield f"attention {impl} fwd+bwd {shape}", bwd_row


# --- the quantized sampler: Pallas kernels in the decode loop ------------------------------

SAMPLER_PRESETS = ("int8_wa_int4_kv", "fp8_wa_fp8_kv", "int4_w")


def _sampler_rows(small: bool, runs: int):
  """Per preset: greedy generation with backend "pallas" against backend "xla" on the same
  weights and prompts. The two compute the same quantized function in a different summation
  order, so tokens agree (a near-tie may flip one; the rest of that row then differs) and, on each
  row's common prefix, log q agrees to float32 rounding of a K-term sum (tolerance 1e-3 nats)."""
  from flax import nnx
  from rl_jax.models.config import ModelConfig
  from rl_jax.models.transformer import Transformer
  from rl_jax.quant.config import QuantConfig
  from rl_jax.sampler import generate as gen
  from rl_jax.sampler import weights as W
  from rl_jax.sampler.config import SamplerConfig
  if small:
    mcfg = ModelConfig(vocab_size=128, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32,
                       d_ff=128, n_experts=4, n_experts_per_tok=2, moe_d_ff=128, mlp_only_layers=(0,),
                       init_std=0.1, tie_embeddings=False)
    b, p, t = 4, 4, 6
  else:  # layer 0 dense, the rest MoE: both quantized matmul paths; K 1024 / 512 / 128 divide every block
    mcfg = ModelConfig(vocab_size=8192, d_model=1024, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=128,
                       d_ff=2048, n_experts=16, n_experts_per_tok=2, moe_d_ff=512, mlp_only_layers=(0,),
                       init_std=0.05, tie_embeddings=False)
    b, p, t = 64, 32, 64
  state = {}

  def setup():
    if not state:
      graphdef, params = nnx.split(Transformer(mcfg, rngs=nnx.Rngs(0)))
      rng = np.random.default_rng(4)
      prompts = jnp.asarray(rng.integers(3, mcfg.vocab_size, (b, p)), jnp.int32)
      state.update(params=params, prompts=prompts, valid=jnp.ones((b, p), bool))
    return state

  def row(preset):
    st = setup()
    out, times = {}, {}
    for backend in ("pallas", "xla"):
      cfg = SamplerConfig(max_prompt_len=p, max_new_tokens=t, greedy=True, record_topk=0, eos_id=1,
                          quant=QuantConfig.preset(preset, backend=backend))
      sstate = W.sync_weights(st["params"], None, cfg.quant, cfg.dtype)
      graphdef = W.sampler_graphdef(mcfg, cfg.dtype)
      fn = lambda sstate=sstate, graphdef=graphdef, cfg=cfg: gen.generate(
          graphdef, sstate, st["prompts"], st["valid"], jax.random.key(0), cfg)
      out[backend] = jax.block_until_ready(fn())
      times[backend] = _timed(fn, runs=runs)
    tok = {k: np.asarray(v.response_BT) for k, v in out.items()}
    logq = {k: np.asarray(v.logq_BT, np.float64) for k, v in out.items()}
    same = np.cumprod(tok["pallas"] == tok["xla"], axis=1).astype(bool)  # each row's common prefix
    if not same[:, 0].all():
      raise AssertionError(f"{int((~same[:, 0]).sum())} rows differ at their first token")
    err = float(np.abs(logq["pallas"] - logq["xla"])[same].max())
    return dict(err=err, tol=1e-3, time_s=times["pallas"], ref_s=times["xla"],
                note=(f"{same.all(axis=1).mean():.0%} of {b} rows identical; "
                      f"{int(same.sum())} tokens compared"))

  shape = f"V={mcfg.vocab_size} D={mcfg.d_model} L={mcfg.n_layers} E={mcfg.n_experts} B={b} P={p} T={t}"
  for preset in SAMPLER_PRESETS:
    yield f"sampler {preset} pallas vs xla, greedy, {shape}", functools.partial(row, preset)


# --- RL: zero mismatch and 10 steps ---------------------------------------------------------


def _rl_rows(sz: Sizes, runs: int, steps: int = 10):
  """Both rows share one trainer: the mismatch check compiles the sampler and the p_old
  forward that run() then reuses (the rollout is deterministic in (seed, step) and
  `prepare` changes no state), so the 10 steps start from the same point as a fresh run."""
  del sz, runs
  state = {}

  def setup():
    if "error" in state:
      raise RuntimeError(f"trainer set-up failed: {state['error']}")
    if "trainer" not in state:
      from configs import countdown_tiny
      from rl_jax.rl import trainer as trainer_lib
      cfg = countdown_tiny.get_config("test")
      cfg.warm_start.source = "none"
      cfg.logging.wandb_mode = "disabled"
      cfg.rl.steps = steps
      cfg.rl.eval_every = cfg.rl.checkpoint_every = steps  # time the steps, not evals / saves
      state["dir"] = tempfile.TemporaryDirectory(prefix="device_check_rl_")
      try:
        t0 = time.perf_counter()
        state["trainer"] = trainer_lib.RLTrainer(cfg, state["dir"].name)
        state["init_s"] = time.perf_counter() - t0
      except Exception as exc:
        state["error"] = f"{type(exc).__name__}: {exc}"
        raise
    return state["trainer"]

  def mismatch():
    tr = setup()
    # GPUs default to TF32 float32 matmuls; the zero-mismatch property is about the code
    # path (same fp32 math in the sampler and the trainer), so compare at full precision.
    ctx = (jax.default_matmul_precision("highest") if jax.default_backend() != "cpu"
           else contextlib.nullcontext())
    with ctx:
      t0 = time.perf_counter()
      problems, ro = tr.rollout(0)
      rewards = tr.score(problems, ro)
      batch, _ = tr.prepare(ro, rewards)
      jax.block_until_ready(batch.logp_old_BT)
      elapsed = time.perf_counter() - t0
    mask = np.asarray(ro.response_mask_BT)
    if not mask.any():
      raise AssertionError("no response tokens to compare")
    diff = np.abs(np.asarray(ro.logq_BT, np.float64) - np.asarray(batch.logp_old_BT, np.float64))
    # Same-math float32 summed in a different order (tests' LOGQ_ATOL).
    return dict(err=float(diff[mask].max()), tol=2e-5, time_s=elapsed,
                note=f"{int(mask.sum())} tokens; time incl. compile")

  def run_steps():
    from rl_jax.metrics import read_metrics
    tr = setup()
    workdir = tr.workdir
    t0 = time.perf_counter()
    tr.run()
    total = time.perf_counter() - t0
    rows = [r for r in read_metrics(str(workdir)) if "reward" in r]
    if len(rows) != steps:
      raise AssertionError(f"{len(rows)} step rows in metrics.jsonl, want {steps}")
    per_step = [sum(v for k_, v in r.items() if k_.startswith("time/")) for r in rows]
    for r in rows:
      if not (np.isfinite(r["loss/loss"]) and np.isfinite(r["loss/grad_norm"])):
        raise AssertionError(f"non-finite loss at step {r['step']}")
    kl = max(abs(r["mismatch/kl_k1"]) for r in rows)
    state["dir"].cleanup()
    return dict(time_s=statistics.median(per_step[1:]),
                note=(f"median step s (steps 2-{steps}); step 1 {per_step[0]:.2f} s (compile); "
                      f"run {total:.1f} s; init {state['init_s']:.1f} s; max abs(kl_k1) {kl:.1e}"))

  yield "rl sampler vs trainer max abs(logq - logp_old) (fp32)", mismatch
  yield f"rl {steps} steps countdown_tiny:test", run_steps


# --- lowering for a CUDA GPU (runs on any machine) -----------------------------------------


def _lower_rows():
  """Each kernel lowered for CUDA at the full sizes, abstractly (no GPU needed, nothing runs).

  Every kernel passes Triton's CompilerParams for the GPU layout, which pick Triton. Under jax
  0.10, where a `pallas_call` without them went to Mosaic GPU (`jax_pallas_use_mosaic_gpu`), a
  kernel that fails its lowering is also tried with the flag flipped, for the note.
  """
  from rl_jax.models import grouped_matmul as G
  from rl_jax.quant import formats as F
  from rl_jax.quant import kernels as K
  from rl_jax.quant import ops
  from rl_jax.quant.config import ActivationSpec, WeightSpec
  sz, opts = FULL, dict(interpret=False, pow2=True)
  sds = jax.ShapeDtypeStruct
  x = sds((sz.codec_m, sz.codec_k), jnp.float32)
  w = sds((sz.codec_g, sz.codec_k, sz.codec_n), jnp.float32)
  k = sz.codec_k

  def lowered(fn, *avals) -> str:
    try:
      text = jax.jit(fn).trace(*avals).lower(lowering_platforms=("cuda",)).as_text()
    except RuntimeError as exc:
      if "No supported GPU devices" in str(exc):  # jax >= 0.11 lowers for CUDA on a GPU host only
        raise Skip(f"jax {jax.__version__} lowers for CUDA only where a GPU is present") from exc
      raise
    kinds = [name for name, tag in (("triton", "xla.gpu.triton"), ("mosaic_gpu", "mosaic_gpu"))
             if tag in text]
    if not kinds:
      raise AssertionError("no Pallas GPU kernel in the lowered program")
    return "+".join(kinds)

  def row(fn, *avals, **bound):
    fn = functools.partial(fn, **bound) if bound else fn

    def check():
      flag = "jax_pallas_use_mosaic_gpu"
      if not hasattr(jax.config, flag):  # jax >= 0.11: Triton is the GPU default, no flag
        return dict(note=f"lowers via {lowered(fn, *avals)}")
      default = bool(getattr(jax.config, flag))
      try:
        return dict(note=f"lowers via {lowered(fn, *avals)}")
      except Exception as exc:
        first = f"{'mosaic_gpu' if default else 'triton'} (default): {type(exc).__name__}: {str(exc)[:160]}"
      jax.config.update(flag, not default)
      try:
        other = f"lowers via {lowered(fn, *avals)}"
      except Exception as exc:
        other = f"{type(exc).__name__}: {str(exc)[:160]}"
      finally:
        jax.config.update(flag, default)
      raise RuntimeError(f"{first}; {'triton' if default else 'mosaic_gpu'}: {other}")
    return check

  for name, block, sd in CODEC_CASES:
    fmt = F.get_format(name)
    tag = f"{name}" + (f"/{block}" if block else "") + f" {sd}"
    # Every case value is bound now (partial): the rows run after the loop ends.
    case = dict(fmt=fmt, block=block, sd=sd)
    yield f"lower quantize_rows {tag}", row(
        lambda x, fmt, block, sd: K.quantize_rows(x, fmt, block, sd, **opts), x, **case)
    yield f"lower dequantize_rows {tag}", row(
        lambda x, fmt, block, sd: K.dequantize_rows(*F.quantize_ref(x, fmt, 1, block, sd), fmt, block,
                                                    sd, k, jnp.float32, **opts), x, **case)
    yield f"lower quantize_cols {tag}", row(
        lambda w, fmt, block, sd: K.quantize_cols(w, fmt, block, sd, **opts), w, **case)
    yield f"lower dequantize_cols {tag}", row(
        lambda w, fmt, block, sd: K.dequantize_cols(*F.quantize_ref(w, fmt, 1, block, sd), fmt, block,
                                                    sd, k, jnp.bfloat16, **opts), w, **case)
  for label, wspec, aspec in [("W8A16 int8", WeightSpec("int8"), None),
                              ("W4A16 int4/32", WeightSpec("int4", "block", 32), None),
                              ("W8A8 fp8 (act. codes)", WeightSpec("fp8"), ActivationSpec("fp8"))]:
    def mm(x2, w2, wspec=wspec, aspec=aspec):
      qt = ops.quantize_weight(w2, wspec, act=aspec, backend="xla")
      common = dict(k=sz.mm_k, w_fmt=qt.fmt, w_block=qt.block_size, w_sd=qt.scale_dtype, **opts)
      if qt.act_format is None:
        return K.qmatmul(x2, qt.values, qt.scales, **common)
      afmt = F.get_format(qt.act_format)
      # Activation codes from the jnp reference: this row lowers qmatmul alone.
      codes, raw = F.quantize_ref(x2, afmt, 1, qt.act_block_size, qt.act_scale_dtype)
      return K.qmatmul(codes, qt.values, qt.scales, x_scales=raw, a_fmt=afmt,
                       a_block=qt.act_block_size, a_sd=qt.act_scale_dtype, **common)
    yield f"lower qmatmul {label}", row(mm, sds((sz.mm_m, sz.mm_k), jnp.float32),
                                        sds((sz.mm_k, sz.mm_n), jnp.float32))
  m, d, f, e = sz.gmm_m, sz.gmm_d, sz.gmm_f, sz.gmm_e

  def gmm_vjp(x2, w2, gs, dy):
    y, vjp = jax.vjp(lambda a, b: G.grouped_matmul(a, b, gs, impl="pallas", interpret=False), x2, w2)
    return (y, *vjp(dy))
  yield "lower grouped_matmul fwd+bwd bf16", row(
      gmm_vjp, sds((m, d), jnp.bfloat16), sds((e, d, f), jnp.bfloat16), sds((e,), jnp.int32),
      sds((m, f), jnp.bfloat16))


# --- driver ---------------------------------------------------------------------------------


def run_checks(sections, sz: Sizes, runs: int, log=print, on_row=None) -> list[Row]:
  """Every row of `sections`; `on_row(rows)` after each one (main writes the table so far, so a
  run cut off by a lease's time limit still leaves every finished row on disk)."""
  builders = {"quant": lambda: [*_codec_rows(sz, runs), *_qmatmul_rows(sz, runs)],
              "gmm": lambda: _gmm_rows(sz, runs),
              "attention": lambda: _attention_rows(sz, runs),
              "sampler": lambda: _sampler_rows(sz is SMALL, runs),
              "rl": lambda: _rl_rows(sz, runs),
              "lower": lambda: _lower_rows()}
  rows = []
  for section in sections:
    try:
      checks = list(builders[section]())
    except Exception as exc:  # building a section's inputs failed: one FAIL row for it
      rows.append(Row(section, status="FAIL", note=f"{type(exc).__name__}: {exc}"))
      log(f"[device_check] {section}: FAIL building inputs: {exc}")
      if on_row is not None:
        on_row(rows)
      continue
    for name, fn in checks:
      row = Row(name)
      t0 = time.perf_counter()
      try:
        out = fn()
        for key, val in out.items():
          setattr(row, key, val)
        if row.tol is not None and not (row.err is not None and row.err <= row.tol):
          row.status = "FAIL"
      except Skip as exc:
        row.status = f"skipped: {exc}"
      except Exception as exc:  # record it; the other rows still run
        row.status = "FAIL"
        row.note = f"{type(exc).__name__}: {str(exc)[:300]}"
        traceback.print_exc()
      log(f"[device_check] {name}: {row.status} ({time.perf_counter() - t0:.1f} s)")
      rows.append(row)
      if on_row is not None:
        on_row(rows)
  return rows


def _fmt(v, spec):
  return "" if v is None else format(v, spec)


def _cell(text: str) -> str:
  return str(text).replace("|", "\\|").replace("\n", " ")  # one markdown cell


def header() -> str:
  dev = jax.devices()[0]
  head = f"device_check: jax {jax.__version__}, backend {jax.default_backend()}, {dev.device_kind}"
  if jax.default_backend() == "cpu":
    head += (" -- CPU: Pallas kernels in INTERPRET mode, small sizes, XLA optimizations off; "
             "errors are real checks, times are not device figures")
  return head


def table(rows: list[Row]) -> str:
  lines = [f"**{header()}**", "",
           "| name | status | max err | tol | time (s) | ref (s) | ratio | note |",
           "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {_cell(r.name)} | {_cell(r.status)} | {_fmt(r.err, '.3g')} | {_fmt(r.tol, '.3g')} | "
                 f"{_fmt(r.time_s, '.4g')} | {_fmt(r.ref_s, '.4g')} | {_fmt(r.ratio, '.3g')} | "
                 f"{_cell(r.note)} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--out", default="", help="directory for device_check.md / .json")
  parser.add_argument("--small", action="store_true", help="small sizes (always on CPU)")
  parser.add_argument("--sections", default=",".join(SECTIONS),
                      help=f"comma-separated subset of {','.join(SECTIONS)}")
  parser.add_argument("--runs", type=int, default=0, help="timed runs per row (default 5, 2 small)")
  args = parser.parse_args(argv)
  sections = [s for s in args.sections.split(",") if s]
  unknown = sorted(set(sections) - set(SECTIONS))
  if unknown:
    parser.error(f"unknown sections {unknown}; choose from {SECTIONS}")
  small = args.small or jax.default_backend() == "cpu"
  if jax.default_backend() == "cpu":
    # A CPU run only shows that every check runs: compiling dominates it, and XLA's backend
    # optimizations roughly halve it (numerics are IEEE either way).
    jax.config.update("jax_disable_most_optimizations", True)
  runs = args.runs or (2 if small else 5)

  def write(rows):
    if not args.out:
      return
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "device_check.md"), "w") as fh:
      fh.write(table(rows) + "\n")
    with open(os.path.join(args.out, "device_check.json"), "w") as fh:
      json.dump({"header": header(), "small": small,
                 "rows": [{**dataclasses.asdict(r), "ratio": r.ratio} for r in rows]}, fh, indent=1)

  t0 = time.perf_counter()
  rows = run_checks(sections, SMALL if small else FULL, runs, on_row=write)
  write(rows)
  print(table(rows))
  print(f"[device_check] {time.perf_counter() - t0:.1f} s total")
  return 1 if any(r.status == "FAIL" for r in rows) else 0


if __name__ == "__main__":
  sys.exit(main())
