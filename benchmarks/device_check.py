"""The prepared accelerator check: the failed rows first, then the sampler, its GPU peer, MoE, attention, the planner's calibration and the train-step peer, within a time budget."""
# Usage:
#   python benchmarks/device_check.py --budget 480 --out DIR   # on one H200: every default row in
#                                                               # ~8 min (estimates: ROW_COST_S)
#   python benchmarks/device_check.py --small                  # small sizes (seconds of work on CPU)
#   python benchmarks/device_check.py --small --sections quant,gmm,attention
#   python benchmarks/device_check.py --sections all           # also the first run's sections
#
# Rows run in the order of --sections (default: PRIORITY, the order issue 39 asks for):
#   fixed         the six rows that FAILED on the H200 (2026-12-04): the fp4/32 e8m0 codecs (signed
#                 zeros) and the W4A16 / W4A4 qmatmul (shared memory), bit-exact / rounding-bounded;
#   sampler       the quantized decode loop, Pallas kernels vs XLA, per preset (below);
#   sampler_peer  benchmarks/bench_sampler_peers.py --torch-device cuda --size gpu: rl_jax's
#                 sampler against HF generate (dynamic cache, and its static cache under
#                 torch.compile) on the same weights and prompts: tokens/s, greedy agreement;
#   moe_bf16      the MoE experts' forward+backward at bf16 as the model wires them
#                 (moe.dropless_experts) under expert_matmul = grouped / ragged_dot, vs the slab;
#   attention     cudnn / blocked (and auto, naming its choice) vs xla at the training shape
#                 (S x S, fwd and fwd+bwd) and the sampler's prefill shape (S = P - 1 queries over
#                 C = P + T cache slots, heads-major cache layout, static offset 0, fwd);
#   calibration   the planner (rl_jax/plan/) compiling the same programs of one config on this
#                 device and on its CPU backend: XLA's memory figures side by side;
#   train_peer    benchmarks/bench_train_peers.py --torch-device cuda --size gpu --models moe: the
#                 MoE update and p_old rows the first run's time limit cut;
#   train_peer_bf16  the same, dense and MoE, at bf16 compute on f32 master weights (torch autocast):
#                 the update against the issue's target (>= 1.5x HF + torch); last, so a tight budget
#                 skips it first.
# And the first run's sections (in --sections all, after the above): lower, quant (the rows not in
# `fixed`), gmm, rl.
#
# --budget SECONDS: before each row, its cost estimate (ROW_COST_S: seconds on one H200 incl.
# compiles, from the 2026-12-04 log where a row ran then) is compared with the time left (the
# budget minus the seconds since this process started); a row that would pass the budget is not
# started and is recorded as "skipped: budget ...", and the later rows are still considered. The
# table is written after every row, so a run cut off by a lease keeps every finished row.
#
# Prints ONE table (and writes device_check.md / device_check.json to --out): per row the
# name, status (ok / FAIL / skipped: reason), max error, tolerance, the median time of the
# checked program, the median time of its reference, and their ratio. Sections in detail:
#   quant      rl_jax/ops/quant_kernels.py: the four codecs (bit-exact vs formats.*_ref: the error
#              is the number of differing elements, tolerance 0) and qmatmul (vs the f32 HIGHEST
#              matmul of the dequantized operands, i.e. ops.qmatmul's xla path);
#   gmm        rl_jax/ops/grouped_matmul.py impl="pallas" forward and forward+backward vs
#              lax.ragged_dot (errors vs ragged_dot on float32 inputs at HIGHEST precision;
#              times vs ragged_dot on the same inputs, which XLA:GPU expands densely), and the
#              MoE experts' forward+backward wired to it (model.expert_matmul="grouped") vs the slab;
#   attention  rl_jax.ops.attention.attention(impl=blocked / cudnn / splash / auto) vs impl="xla"
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
# check runs; the table header says so. The packages the device machine lacks travel as wheels:
# benchmarks/README.md.
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
import subprocess
import tempfile
import time
import traceback

_T0 = time.perf_counter()  # the budget counts from here: jax's start-up is part of it

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

# Issue 39's order: what a short lease must cover first comes first.
PRIORITY = ("fixed", "sampler", "sampler_peer", "moe_bf16", "attention", "calibration", "train_peer",
            "train_peer_bf16")
SECTIONS = PRIORITY + ("lower", "quant", "gmm", "rl")

# The six rows that failed on the H200 (2026-12-04), fixed on CPU since.
FIXED_ROWS = ("quant quantize_rows fp4/32 e8m0", "quant dequantize_rows fp4/32 e8m0",
              "quant quantize_cols fp4/32 e8m0", "quant dequantize_cols fp4/32 e8m0",
              "quant qmatmul W4A16 int4/32", "quant qmatmul W4A4 fp4")

# Cost of a row on one H200 in seconds, compiles included, by name prefix (the longest matching
# prefix wins): the 2026-12-04 log's figures where the row ran then (fp4 codecs 4.8-12.3 s, int8
# qmatmul 23 s, gmm 8-38 s, attention 2-19 s, rl 17-22 s), rounded up; the others are estimates from
# the compiles they hold (a sampler preset: two generate programs; a peer: a subprocess with
# jax's and torch's start-up, torch.compile of the static cache, 3 rounds). Unknown rows: 30 s.
ROW_COST_S = {
    "quant quantize_rows": 6, "quant dequantize_rows": 8, "quant quantize_cols": 13,
    "quant dequantize_cols": 9, "quant qmatmul": 12,
    "sampler ": 30, "sampler_peer": 120, "moe_bf16": 15, "attention": 8,
    "attention blocked fwd+bwd": 20, "attention cudnn fwd+bwd": 11, "calibration": 30, "train_peer": 90, "train_peer_bf16": 150,
    "lower": 1, "gmm": 35, "rl ": 25,
}
# The issue's sections add up to ~480 s: fixed 60, sampler 90, sampler_peer 120, moe_bf16 45,
# attention ~95 (splash skips at once), calibration 30, train_peer 90; train_peer_bf16 (150) runs
# after them only if the budget still holds it; rows after a section's
# first that only read a result already computed (peers, calibration) cost ~0 (PAID_ROW_COST_S).
PAID_ROW_COST_S = 1.0
DEFAULT_ROW_COST_S = 30.0


def row_cost(name: str) -> float:
  """ROW_COST_S of the longest prefix of `name` (DEFAULT_ROW_COST_S if none)."""
  keys = [k for k in ROW_COST_S if name.startswith(k)]
  return float(ROW_COST_S[max(keys, key=len)]) if keys else DEFAULT_ROW_COST_S
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
  pre_b: int = 2    # the sampler's prefill: rows, prompt slots P (queries P - 1), new tokens T
  pre_p: int = 24
  pre_t: int = 16


FULL = Sizes(codec_m=4096, codec_k=4096, codec_g=4, codec_n=2048, mm_m=2048, mm_k=4096, mm_n=4096,
             gmm_m=16384, gmm_d=2048, gmm_f=768, gmm_e=64,  # Qwen3-30B-A3B's expert shapes, E/2
             att_b=4, att_s=2048, att_g=4, att_r=4, att_d=128, pre_b=16, pre_p=1024, pre_t=1024)
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
  # As rl_jax.ops.quantized: no Pallas compiler on CPU (interpret), Triton wants power-of-two blocks.
  platform = jax.default_backend()
  return dict(interpret=platform == "cpu", pow2=platform == "gpu")


# --- quant kernels --------------------------------------------------------------------------


# (format, block or None, scale dtype): per-channel int8, and MXFP4-like packed fp4 blocks.
CODEC_CASES = [("int8", None, "fp32"), ("fp4", 32, "e8m0")]


def _codec_rows(sz: Sizes, runs: int):
  from rl_jax.quant import formats as F
  from rl_jax.ops import quant_kernels as K
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
  from rl_jax.ops import quant_kernels as K
  from rl_jax.ops import quantized as ops
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
  from rl_jax.ops import grouped_matmul as G
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
  """Training shape (S x S, bcgd layout): fwd and fwd+bwd of blocked / cudnn / splash / auto vs xla;
  the sampler's prefill shape (P - 1 queries over P + T heads-major cache slots at the static
  offset 0, left-padded prompts): fwd of blocked / cudnn / auto vs xla."""
  b, s, g, r, d = sz.att_b, sz.att_s, sz.att_g, sz.att_r, sz.att_d
  rng = np.random.default_rng(3)
  # Errors relative to max |v| (outputs) or max |reference gradient|: bf16 q / k / v, each
  # implementation rounding scores, probabilities and the output at ~2**-8 (scores of a few
  # units), hence 8 x 2**-8.
  att_tol = 8 * _UBF16

  try:
    from rl_jax import impl_log
    from rl_jax.ops import attention as A
  except ImportError as exc:
    for impl in ("blocked", "cudnn", "splash"):
      def missing(exc=exc):
        raise Skip(f"rl_jax.ops.attention missing ({exc})")
      yield f"attention {impl}", missing
    return

  def case(b, s, c, layout):
    """bf16 inputs, their float32 copies (the same values), the key mask and the queries that see a key."""
    pad = rng.integers(0, min(s, c) // 4 + 1, (b, 1))  # left padding, the layouts the project builds
    if layout == "bcgd":
      shapes = ((b, s, g, r, d), (b, c, g, d), (b, c, g, d))
      valid = np.arange(c)[None] >= pad
    else:  # the KV cache's kT_BGDC / v_BGCD; prompt slots [0, s] left-padded, response slots valid
      shapes = ((b, s, g, r, d), (b, g, d, c), (b, g, c, d))
      valid = (np.arange(c)[None] >= pad)
    bf = [jnp.asarray(rng.standard_normal(sh, dtype=np.float32), jnp.bfloat16) for sh in shapes]
    f32 = [x.astype(jnp.float32) for x in bf]
    seen_q = jnp.asarray(np.arange(s)[None] >= pad)[:, :, None, None, None]
    return bf, f32, jnp.asarray(valid), seen_q

  def fwd(impl, valid, layout):
    return jax.jit(lambda q, k, v: A.attention(q, k, v, valid, impl=impl, kv_layout=layout))

  def fwd_bwd(impl, valid, cot, seen_q):
    def loss(q, k, v):
      out = A.attention(q, k, v, valid, impl=impl).astype(jnp.float32)
      # Only queries that see a key: a left-padding query's value is never read.
      return jnp.sum(jnp.where(seen_q, out * cot, 0.0))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))

  def unsupported(impl, bf, valid, layout):
    if impl in ("blocked", "auto"):
      return None
    return getattr(A, f"_{impl}_unsupported")(bf[0], bf[1], bf[2], valid, 0, True, layout)

  def chosen(kern, *args):
    """Runs the first (tracing) call under impl_log and names what `auto` resolved to."""
    with impl_log.recording() as log:
      out = kern(*args)
    return out, "+".join(sorted(log.get("attention", {}))) or "?"

  def rows_for(tag, b, s, c, layout, impls, backward):
    state = {}

    def inputs():
      if not state:
        bf, f32, valid, seen_q = case(b, s, c, layout)
        state.update(bf=bf, f32=f32, valid=valid, seen_q=seen_q, vmax=float(jnp.max(jnp.abs(f32[2]))))
        with jax.default_matmul_precision("highest"):
          state["ref_out"] = fwd("xla", valid, layout)(*f32)
        if backward:
          state["cot"] = jnp.asarray(rng.standard_normal((b, s, g, r, d), dtype=np.float32))
          with jax.default_matmul_precision("highest"):
            state["ref_grads"] = fwd_bwd("xla", valid, state["cot"], seen_q)(*f32)[1]
      return state

    def fwd_row(impl):
      st = inputs()
      reason = unsupported(impl, st["bf"], st["valid"], layout)
      if reason:
        raise Skip(reason)
      kern, ref = fwd(impl, st["valid"], layout), fwd("xla", st["valid"], layout)
      out, took = chosen(kern, *st["bf"])
      err = float(jnp.max(jnp.where(st["seen_q"], jnp.abs(out.astype(jnp.float32) - st["ref_out"]), 0.0))) / st["vmax"]
      note = "err / max abs(v); vs xla f32" + (f"; auto ran {took}" if impl == "auto" else "")
      return dict(err=err, tol=att_tol, time_s=_timed(kern, *st["bf"], runs=runs),
                  ref_s=_timed(ref, *st["bf"], runs=runs), note=note)

    def bwd_row(impl):
      st = inputs()
      reason = unsupported(impl, st["bf"], st["valid"], layout)
      if reason:
        raise Skip(reason)
      kern = fwd_bwd(impl, st["valid"], st["cot"], st["seen_q"])
      ref = fwd_bwd("xla", st["valid"], st["cot"], st["seen_q"])
      (_, grads), took = chosen(kern, *st["bf"])
      errs = [float(jnp.max(jnp.abs(gr.astype(jnp.float32) - rg)) / jnp.max(jnp.abs(rg)))
              for gr, rg in zip(grads, st["ref_grads"])]
      note = "dq/dk/dv err / max abs(ref grad) " + "/".join(f"{e_:.1e}" for e_ in errs)
      return dict(err=max(errs), tol=att_tol, time_s=_timed(kern, *st["bf"], runs=runs),
                  ref_s=_timed(ref, *st["bf"], runs=runs),
                  note=note + (f"; auto ran {took}" if impl == "auto" else ""))

    for impl in impls:
      yield f"attention {impl} fwd {tag}", functools.partial(fwd_row, impl)
      if backward:
        yield f"attention {impl} fwd+bwd {tag}", functools.partial(bwd_row, impl)

  yield from rows_for(f"train B={b} S={s} G={g} R={r} D={d} bf16", b, s, s, "bcgd",
                      ("cudnn", "blocked", "auto", "splash"), True)
  pb, pp, pt = sz.pre_b, sz.pre_p, sz.pre_t
  yield from rows_for(f"prefill B={pb} S={pp - 1} C={pp + pt} G={g} R={r} D={d} bf16 cache layout", pb, pp - 1,
                      pp + pt, "cache", ("cudnn", "blocked", "auto"), False)


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


# --- bf16 experts as the model wires them ----------------------------------------------------


def _moe_bf16_rows(sz: Sizes, runs: int):
  """moe.dropless_experts forward+backward in bf16 (the pod configs' compute dtype) under
  expert_matmul = grouped / ragged_dot, each against the slab on the same inputs (time), and
  all three against the slab's float32 HIGHEST result on the same bf16-rounded values (error,
  relative to the largest |y| / gradient entry). Tolerance: bf16 rounds the gated product's
  three operands and its output once each (2**-8 relative each, 4 x 2**-8), and every
  program also rounds its own intermediate h to bf16 (x2): 8 x 2**-8."""
  from rl_jax.models import moe
  n, k = sz.gmm_m // 2, 2
  d, f, e = sz.gmm_d, sz.gmm_f, sz.gmm_e
  rng = np.random.default_rng(5)
  state = {}

  def inputs():
    if not state:
      p = rng.dirichlet(np.full(e, 0.5))
      ids = jnp.asarray(np.stack([rng.choice(e, k, replace=False, p=p) for _ in range(n)]), jnp.int32)
      gates = jnp.full((n, k), 0.5, jnp.float32)
      x = jnp.asarray(rng.standard_normal((n, d)), jnp.bfloat16)
      ws = tuple(jnp.asarray(rng.standard_normal(sh) / math.sqrt(sh[1]), jnp.bfloat16)
                 for sh in ((e, d, f), (e, d, f), (e, f, d)))
      state.update(ids=ids, gates=gates, x=x, ws=ws)
      with jax.default_matmul_precision("highest"):
        f32 = lambda a: a.astype(jnp.float32)
        state["want"] = program("slab")(f32(x), *map(f32, ws))[1]
    return state

  def program(matmul):
    def loss(x, *w):
      st = state
      y = moe.dropless_experts(x, st["ids"], st["gates"], *w, e, matmul=matmul)
      return jnp.sum(y.astype(jnp.float32) ** 2)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))

  def row(matmul):
    if matmul == "grouped" and jax.default_backend() == "tpu":
      raise Skip("the Triton-style grouped kernel is for GPU")
    st = inputs()
    kern, ref = program(matmul), program("slab")
    _, got = kern(st["x"], *st["ws"])
    errs = [float(jnp.max(jnp.abs(a.astype(jnp.float32) - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-30))
            for a, b in zip(got, st["want"])]
    return dict(err=max(errs), tol=8 * _UBF16, time_s=_timed(kern, st["x"], *st["ws"], runs=runs),
                ref_s=_timed(ref, st["x"], *st["ws"], runs=runs),
                note="vs slab time; err vs slab f32 HIGHEST, grads x/w_gate/w_up/w_down "
                     + "/".join(f"{v:.1e}" for v in errs))

  shape = f"N={n} K={k} D={d} F={f} E={e} bf16"
  for matmul in ("grouped", "ragged_dot", "slab"):
    yield f"moe_bf16 {matmul} fwd+bwd vs slab {shape}", functools.partial(row, matmul)


# --- peers and the planner: subprocesses / the planner's own code -----------------------------


def _paid_or_full(state: dict, full: float) -> float:
  """A shared-result row's cost: ~0 once its section's result (or error) exists, else `full`."""
  return PAID_ROW_COST_S if state else full


def _subprocess_json(cmd: list[str], out_dir: str, stem: str, timeout: float) -> dict:
  """Runs a benchmark script (cwd: the repo) with `--json` (read back from a temporary file: the
  table holds its figures), its log kept as out_dir/stem.log (a lease returns few files)."""
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  tmp = tempfile.mkdtemp(prefix="device_check_")
  path = os.path.join(tmp, f"{stem}.json")
  env = dict(os.environ, PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1")
  try:
    proc = subprocess.run([sys.executable, *cmd, "--json", path], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=max(1.0, timeout) if math.isfinite(timeout) else None)
  except subprocess.TimeoutExpired as exc:
    raise RuntimeError(f"{stem}: over its {timeout:.0f} s (the budget left)") from exc
  with open(os.path.join(out_dir or tmp, f"{stem}.log"), "w") as fh:
    fh.write(proc.stdout + proc.stderr)
  if proc.returncode != 0:
    raise RuntimeError(f"{stem} exit {proc.returncode}: {(proc.stdout + proc.stderr)[-400:]}")
  with open(path) as fh:
    return json.load(fh)


def _sampler_peer_rows(small: bool, out_dir: str, left):
  """One row per (model, mode) of bench_sampler_peers against HF on CUDA: time per token of
  rl_jax (recording off) vs the best HF variant; greedy rows name the token agreement."""
  state = {}

  def result():
    if jax.default_backend() != "gpu":
      raise Skip(f"the HF CUDA peer needs a GPU (this backend is {jax.default_backend()!r})")
    if "error" in state:
      raise RuntimeError(state["error"])
    if "rows" not in state:
      try:
        import torch  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
      except ImportError as exc:
        raise Skip(f"torch is not installed ({exc})") from exc
      cmd = ["benchmarks/bench_sampler_peers.py", "--torch-device", "cuda", "--hf_threads", "1",
             "--hf_impls", "sdpa/eager,sdpa/grouped_mm", "--reps", "3"] + (["--small"] if small else ["--size", "gpu"])
      try:
        state["rows"] = _subprocess_json(cmd, out_dir, "sampler_peers", left())["rows"]
      except Exception as exc:
        state["error"] = f"{type(exc).__name__}: {exc}"
        raise
    return state["rows"]

  def row(model, mode):
    rows = [r for r in result() if r["model"] == model and r["mode"] == mode]
    if not rows:
      raise AssertionError(f"no {model} {mode} row in the peer's output")
    r = rows[0]
    tok_s = r["tok_s"]
    peers = {k: v for k, v in tok_s.items() if k not in ("off", "on")}
    best = max(peers, key=peers.get)
    note = (f"tok/s rl_jax {tok_s['off']:.0f} (recording on {tok_s['on']:.0f}), best HF {best} {peers[best]:.0f}; "
            f"rl_jax / HF x{r['ratio_off']:.2f} (target >= 1.5)")
    if r.get("agreement"):
      note += "; greedy agreement " + ", ".join(f"{k} {v:.3f}" for k, v in r["agreement"].items())
    return dict(time_s=1.0 / tok_s["off"], ref_s=1.0 / peers[best], note=note)

  for model, mode in ((m, k) for m in ("dense", "moe") for k in ("greedy", "T=1")):
    name = f"sampler_peer {model} {mode} rl_jax vs HF generate (cuda), s/token"
    yield name, functools.partial(row, model, mode), functools.partial(_paid_or_full, state, row_cost(name))


def _train_peer_rows(small: bool, out_dir: str, left, dtype: str = "float32"):
  """f32: the MoE rows the first run's time limit cut, update and p_old against HF + torch on CUDA;
  bf16: dense and MoE updates at bf16 compute (f32 master weights) on both sides."""
  state = {}
  bf16 = dtype == "bfloat16"
  models = ("dense", "moe") if bf16 else ("moe",)
  tag = "train_peer_bf16" if bf16 else "train_peer"

  def result():
    if jax.default_backend() != "gpu":
      raise Skip(f"the torch CUDA peer needs a GPU (this backend is {jax.default_backend()!r})")
    if "error" in state:
      raise RuntimeError(state["error"])
    if "rows" not in state:
      cmd = ["benchmarks/bench_train_peers.py", "--torch-device", "cuda", "--threads", "1", "--models",
             ",".join(models), "--settle", "0.2", "--dtype", dtype]
      cmd += ["--small"] if small else ["--size", "gpu", "--rounds", "3", "--batch", "32", "--prompt", "64",
                                        "--response", "448"]
      try:
        state["rows"] = _subprocess_json(cmd, out_dir, tag.replace("train_peer", "train_peers"), left())["rows"]
      except Exception as exc:
        state["error"] = f"{type(exc).__name__}: {exc}"
        raise
    return state["rows"]

  def row(model, phase):
    r = next((r for r in result() if r["model"] == model and r["phase"] == phase), None)
    if r is None:
      raise AssertionError(f"no {model} {phase} row in the peer's output")
    how = ("bf16 autocast on f32 masters; losses checked equal to 2**-6 first" if bf16 else
           "f32, no TF32; losses and gradients checked equal first")
    return dict(time_s=r["rl_jax_s"], ref_s=r["hf_s"],
                note=f"HF / rl_jax x{r['hf_s'] / r['rl_jax_s']:.2f} (> 1: rl_jax faster); {how} ({tag}s.log)")

  for model, phase in ((m, ph) for m in models for ph in (("update",) if bf16 else ("update", "p_old"))):
    name = f"{tag} {model} {phase} rl_jax vs HF + torch (cuda), s"
    yield name, functools.partial(row, model, phase), functools.partial(_paid_or_full, state, row_cost(name))


CALIBRATION_CONFIG = "configs/countdown_tiny.py:test"
CALIBRATION_PROGRAMS = ("generate", "old_forward", "update")


def _calibration_rows(out_dir: str):
  """The planner's programs for one config compiled twice by rl_jax.plan (same code, same
  abstract inputs): on this device and on its host CPU backend. Per program: XLA's temporaries
  on the device (time_s column: GiB) against the CPU compile's (ref_s column: GiB); the note
  adds arguments and outputs. The planner's estimates are CPU compiles: this ratio is how far
  they are from a device's own."""
  state = {}
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

  def plans():
    if jax.default_backend() == "cpu":
      raise Skip("the calibration compares a device compile with the CPU's: this backend is the CPU")
    if "error" in state:
      raise RuntimeError(state["error"])
    if "by" not in state:
      try:
        from rl_jax.plan import config as plan_config
        from rl_jax.plan import report as plan_report
        from rl_jax import sharding as sh
        from rl_jax.rl.job import RLJob
        config = plan_config.load_config(os.path.join(repo, CALIBRATION_CONFIG))
        job = RLJob.from_config(config)
        by = {}
        for where, devs in (("device", jax.devices()[:1]), ("cpu", jax.devices("cpu")[:1])):
          mesh = sh.make_mesh(job.mesh, devs)
          got, _ = plan_report.run(config, "h200", 1, mesh=mesh, programs=CALIBRATION_PROGRAMS, out=lambda *_: None)
          by[where] = {p.name: p for p in got}
        state["by"] = by
        if out_dir:
          with open(os.path.join(out_dir, "calibration.json"), "w") as fh:
            json.dump({"config": CALIBRATION_CONFIG, "device": jax.devices()[0].device_kind,
                       **{w: {n: dataclasses.asdict(p) for n, p in ps.items()} for w, ps in by.items()}}, fh, indent=1)
      except Exception as exc:
        state["error"] = f"{type(exc).__name__}: {exc}"
        raise
    return state["by"]

  def row(name):
    by = plans()
    dev, cpu = by["device"][name], by["cpu"][name]
    gib = lambda n: n / 2**30
    return dict(time_s=gib(dev.temp), ref_s=gib(cpu.temp) or None,
                note=(f"GiB temporaries device/cpu {gib(dev.temp):.4f}/{gib(cpu.temp):.4f}; arguments "
                      f"{gib(dev.argument):.4f}/{gib(cpu.argument):.4f}; outputs "
                      f"{gib(dev.output):.4f}/{gib(cpu.output):.4f}"))

  for name in CALIBRATION_PROGRAMS:
    label = f"calibration plan {CALIBRATION_CONFIG} {name}: device vs CPU compile (GiB, not s)"
    yield label, functools.partial(row, name), functools.partial(_paid_or_full, state, row_cost(label))


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
      from rl_jax.configs import countdown_tiny
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
  from rl_jax.ops import grouped_matmul as G
  from rl_jax.quant import formats as F
  from rl_jax.ops import quant_kernels as K
  from rl_jax.ops import quantized as ops
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


def run_checks(sections, sz: Sizes, runs: int, log=print, on_row=None, budget_s: float | None = None,
               out_dir: str = "", cost=row_cost, clock=None) -> list[Row]:
  """Every row of `sections`, in order; `on_row(rows)` after each one (main writes the table so far,
  so a run cut off by a lease's time limit still leaves every finished row on disk).

  `budget_s`: a row whose `cost(name)` estimate is more than the seconds left (`budget_s` minus
  `clock()`, default: seconds since this module loaded) is not started: it is recorded as
  skipped with both figures, and the later (cheaper) rows are still considered.
  """
  clock = clock or (lambda: time.perf_counter() - _T0)
  left = lambda: float("inf") if budget_s is None else budget_s - clock()
  small = sz is SMALL
  builders = {"fixed": lambda: [c for c in (*_codec_rows(sz, runs), *_qmatmul_rows(sz, runs)) if c[0] in FIXED_ROWS],
              "quant": lambda: [c for c in (*_codec_rows(sz, runs), *_qmatmul_rows(sz, runs))
                                if c[0] not in FIXED_ROWS],
              "gmm": lambda: _gmm_rows(sz, runs),
              "attention": lambda: _attention_rows(sz, runs),
              "sampler": lambda: _sampler_rows(small, runs),
              "sampler_peer": lambda: _sampler_peer_rows(small, out_dir, left),
              "moe_bf16": lambda: _moe_bf16_rows(sz, runs),
              "calibration": lambda: _calibration_rows(out_dir),
              "train_peer": lambda: _train_peer_rows(small, out_dir, left),
              "train_peer_bf16": lambda: _train_peer_rows(small, out_dir, left, "bfloat16"),
              "rl": lambda: _rl_rows(sz, runs),
              "lower": lambda: _lower_rows()}
  rows = []

  def done(row):
    rows.append(row)
    if on_row is not None:
      on_row(rows)

  for section in sections:
    try:
      checks = list(builders[section]())
    except Exception as exc:  # building a section's inputs failed: one FAIL row for it
      log(f"[device_check] {section}: FAIL building inputs: {exc}")
      done(Row(section, status="FAIL", note=f"{type(exc).__name__}: {exc}"))
      continue
    for name, fn, *est_given in checks:
      row = Row(name)
      # A row may carry its own estimate: a number, or a callable (a section's later rows that
      # read a result its first row computed cost ~0 once it exists, the full cost before).
      given = est_given[0] if est_given else None
      est = float(given() if callable(given) else given) if given is not None else cost(name)
      remaining = left()
      if est > remaining:
        row.status = f"skipped: budget (estimate {est:.0f} s > {max(remaining, 0):.0f} s left)"
        log(f"[device_check] {name}: {row.status}")
        done(row)
        continue
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
      log(f"[device_check] {name}: {row.status} ({time.perf_counter() - t0:.1f} s, estimate {est:.0f} s)")
      done(row)
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
  parser.add_argument("--sections", default=",".join(PRIORITY),
                      help=f"comma-separated, run in the order given: {','.join(SECTIONS)} ('all': every "
                           "one, the priority ones first)")
  parser.add_argument("--budget", type=float, default=None,
                      help="seconds for the whole run (from process start): rows whose estimate "
                           "(ROW_COST_S) would pass it are skipped, not started")
  parser.add_argument("--runs", type=int, default=0, help="timed runs per row (default 5, 2 small)")
  args = parser.parse_args(argv)
  sections = list(SECTIONS) if args.sections == "all" else [s for s in args.sections.split(",") if s]
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
      json.dump({"header": header(), "small": small, "budget_s": args.budget, "sections": sections,
                 "rows": [{**dataclasses.asdict(r), "ratio": r.ratio} for r in rows]}, fh, indent=1)

  t0 = time.perf_counter()
  rows = run_checks(sections, SMALL if small else FULL, runs, on_row=write, budget_s=args.budget,
                    out_dir=args.out)
  write(rows)
  print(table(rows))
  print(f"[device_check] {time.perf_counter() - t0:.1f} s total")
  return 1 if any(r.status == "FAIL" for r in rows) else 0


if __name__ == "__main__":
  sys.exit(main())
