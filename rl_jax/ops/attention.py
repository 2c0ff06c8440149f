"""GQA attention under a causal + per-slot key mask, without a dense mask: xla, blocked, native, cudnn, splash."""
# One entry point, `attention`. The mask is structured, never a dense [B, S, C] array: query i
# sits at slot `q_offset + i` and reads key slot c iff (not causal or c <= q_offset + i) and
# kv_valid_BC[b, c]. Query head h = g * R + r reads kv head g (transformers' repeat_kv order).
#
# The model's two call sites (layers.Attention):
#
#   trainer, no cache (the mask tril(S, S) & valid_BS[:, None, :]):
#     attention(q_BSGRD, k_BSGD, v_BSGD, valid_BS, impl=cfg.attention)
#   prefill over the C cache slots (the mask (slot_C <= cache_index + arange(S)) & kv_valid_BC):
#     attention(q_BSGRD.astype(f32), kT_BGDC.astype(f32), v_BGCD, kv_valid_BC,
#               q_offset=cache_index, kv_layout="cache", impl=cfg.attention)
#
# The single-token decode (`layers._decode_attention`) stays apart: its scores are [B, G, R, C].
#
# Implementations (`impl`):
#   xla     today's computation: one masked softmax per query block (`_causal_attention`, the
#           trainer's S x S case) or over all C keys (`_attend`, anything else), f32 scores
#           [B, G, R, S, C] (the model's attention before this module, moved here unchanged).
#   blocked blocked online softmax written in jnp/lax loops (query blocks x key blocks, f32
#           running max and sum), custom VJP that recomputes the blocks; key blocks above the
#           causal diagonal are skipped by dynamic loop bounds. O(S * D + block^2) temporaries.
#           Not a fused kernel: XLA compiles each block's dots and softmax separately (on one
#           H200 it ran 1.8-2x slower than `xla`, docs/performance.md); it is the portable answer
#           to memory at long sequences. `flash` is its old name, kept as a deprecated alias.
#   native  CPU, float32, the trainer's no-cache case (bcgd keys over the S tokens themselves,
#           q_offset the static 0): forward and backward FFI handlers (`native_causal_attention`)
#           that take one (row, kv head) at a time in the model's layout, scores in the thread's
#           scratch, the causal limit key by key; custom VJP from the row max and sum. Explicitly
#           asked for where it cannot serve: auto's choice, with a one-time warning.
#   cudnn   jax.nn.dot_product_attention(implementation="cudnn") on GPU. That API expresses
#           padding only as per-row lengths (keys [0, len), "right padding"; a `mask` becomes a
#           dense [B, N, T, S] bias), and its causal mask is top-left aligned. So: q_offset must
#           be the static 0, q / k / v bf16 or fp16, head dim a multiple of 8 (<= 128, <= 256 from
#           Hopper on); a row whose valid keys are one contiguous run [start, end) (left and/or
#           right padding: every layout the project builds) is rotated left by `start` so its
#           run begins at slot 0, and the output rotated back. Rows that are not one run (or have
#           no valid key) send the whole batch to blocked through a lax.cond (data-dependent, so
#           no warning is possible there). Anything else falls back to blocked with a one-time
#           warning.
#   splash  the TPU Pallas splash kernel: CausalMask(offset=q_offset) (q_offset a static int)
#           and segment ids (valid key 0, padding key 1, every query 0) for the key mask;
#           S and C are padded to a multiple of 128. Elsewhere, or with a traced q_offset, blocked
#           with a one-time warning.
#   auto    `auto_impl`, a pure function of (backend, dtype, shapes, offset, whether native can
#           serve): cudnn on GPU where expressible, splash on TPU where expressible, native on CPU
#           where it serves (`native_reason` is None); otherwise xla, or blocked where it wins
#           (CPU from S * C >= _AUTO_BLOCKED_MIN_SC) or where xla's f32 score buffer would pass
#           _AUTO_MAX_SCORE_BYTES (memory forces it; GPU / TPU).
#
# Every resolved choice is recorded at trace time (`rl_jax.paths`), so a test or a benchmark can
# say which implementation a compiled program holds.
#
# A query that sees no key at all (left padding before the first real token) gets a finite
# value nothing reads: with the finite mask value -1e30 its weights are uniform over the keys
# the implementation visited (xla: its query block's keys, blocked: the key blocks up to its
# causal limit, splash likewise; cudnn: 0). Never NaN, in the forward or in any gradient.
from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
from jax import lax

from rl_jax import impl_log
from rl_jax.ops import native_causal_attention
from rl_jax.ops.batch_invariant import ordered_sum

# "flash": the deprecated name of "blocked" (a warning, then blocked).
IMPLEMENTATIONS = ("auto", "xla", "blocked", "native", "cudnn", "splash", "flash")
KV_LAYOUTS = ("bcgd", "cache")  # k_BCGD, v_BCGD | the KV cache's kT_BGDC, v_BGCD (kv_cache.LayerKV)

# Finite "minus infinity": a fully masked row (padding query) stays NaN-free.
MASK_VALUE = -1e30

# Blocked attention's block sizes (queries x keys per block; a block's f32 scores are [B, G, block_q * R,
# block_k]). fwd+bwd on XLA:CPU, issue 15's heads (8 x 32, 4 KV heads), 5120 tokens, blocks
# 128 / 256 / 512: S = 160 (B 32) 0.143 / 0.071 / 0.066 s, S = 1024 (B 5) 0.186 / 0.180 /
# 0.278 s, S = 2048 (B 2) 0.268 / 0.219 / 0.334 s (xla: 0.056-0.062, 0.318-0.350, 0.626-0.792 s).
# Key block of the batch-invariant mode (`attention(invariant=True)`): every forward's keys are
# padded to whole blocks of it, so small enough not to waste a short sequence's work.
INVARIANT_BLOCK_K = 64
DEFAULT_BLOCK_Q = 256
DEFAULT_BLOCK_K = 256

# auto on CPU (or where cudnn / splash cannot express the inputs): blocked from S * C >= this.
# `python benchmarks/bench_attention.py --S 160 256 384 512 768 1024 2048 --heads 4 --kv-heads 2
# --head-dim 16` (the tiny model's heads, B = 5120 // S, left-padded rows, 2 shared cores, load
# ~1-3), fwd+bwd wall median blocked / xla: S = 160 0.90x (one block either way), 256 1.01x,
# 384 1.08x, 512 0.77x, 768 0.55x, 1024 0.43x, 2048 0.26x; issue 15's heads (8 x 32): 256
# 1.34x, 384 1.44x, 512 0.95x, 768 0.76x, 1024 0.57x, 2048 0.35x. Below 512 x 512 the two are
# within noise or xla wins, and xla is today's code bit for bit (the tiny configs' S = 36 keep it).
_AUTO_BLOCKED_MIN_SC = 512 * 512
_AUTO_FLASH_MIN_SC = _AUTO_BLOCKED_MIN_SC  # the old name

# auto on GPU / TPU where the fused kernel cannot take the inputs (float32 q / k / v, a traced
# offset): xla, unless its float32 scores [B, G, R, S, C] (and, under a gradient, the
# probabilities it keeps: about twice that) would pass this many bytes; then blocked. On one
# H200 (B=4 S=2048 G=4 R=4 D=128 bf16, docs/performance.md) blocked ran 1.97x / 1.77x the time
# of xla (fwd / fwd+bwd): it wins nowhere there, so only memory sends a program to it. 4 GiB of
# one layer's scores is ~3% of an H200 and the size at which the 30B config's planned programs
# (docs/plans/) start to feel it; it is a memory rule, not a speed measurement.
_AUTO_MAX_SCORE_BYTES = 4 * 2**30


def auto_impl(backend: str, dtype, b: int, s: int, c: int, heads: int, head_dim: int, *,
              static_zero_offset: bool, static_offset: bool, causal: bool = True,
              capability: tuple[int, int] = (9, 0), native: bool = False) -> str:
  """What `impl="auto"` runs, as a pure function of the backend, q / k / v dtype and shapes.

  `static_zero_offset`: q_offset is the Python int 0; `static_offset`: it is a Python int;
  `capability`: the GPU's compute capability (cuDNN's head-dim limit); `native`: the native CPU
  attention can serve the call (`native_reason(...) is None`). The measured basis is in the
  comments above (_AUTO_BLOCKED_MIN_SC, _AUTO_MAX_SCORE_BYTES) and in docs/performance.md.
  """
  if backend == "cpu" and native:
    return "native"
  if backend == "gpu" and cudnn_reason(jnp.dtype(dtype), head_dim, static_zero_offset, causal, capability) is None:
    return "cudnn"
  if backend == "tpu" and (static_offset or not causal):
    return "splash"
  if backend in ("gpu", "tpu"):
    return "blocked" if 4 * b * heads * s * c > _AUTO_MAX_SCORE_BYTES else "xla"
  return "blocked" if s * c >= _AUTO_BLOCKED_MIN_SC else "xla"


def attention(q_BSGRD: jax.Array, k: jax.Array, v: jax.Array, kv_valid_BC: jax.Array | None = None, *,
              q_offset: int | jax.Array = 0, causal: bool = True, kv_layout: str = "bcgd",
              impl: str = "auto", block_q: int = DEFAULT_BLOCK_Q, block_k: int = DEFAULT_BLOCK_K,
              invariant: bool = False) -> jax.Array:
  """softmax(q k^T / sqrt(D), masked) v -> out_BSGRD (dtype of v).

  Args:
    q_BSGRD: queries, S tokens x G kv heads x R query heads per kv head x head dim D.
    k, v: keys / values over C slots: k_BCGD, v_BCGD (`kv_layout="bcgd"`), or the KV cache's
      heads-major kT_BGDC, v_BGCD (`kv_layout="cache"`).
    kv_valid_BC: bool, which key slots hold real tokens (any per-row pattern); None = all.
    q_offset: slot of query 0, >= 0 (int, or an int scalar array under jit: the cache index), or
      an int `[B]` array, row b's own (the continuous engine's refill prefill; xla and blocked,
      forward only).
    causal: query at slot q reads key slots c <= q only.
    impl: one of IMPLEMENTATIONS (module comment); cudnn / splash fall back to blocked (one
      warning per reason) where they cannot run the inputs, auto silently.
    block_q / block_k: blocked's block sizes (clipped to S / C).
    invariant: the batch-invariant mode (`ModelConfig.batch_invariant`): blocked whatever `impl`,
      one query slot per block and key blocks of INVARIANT_BLOCK_K slots from slot 0, never
      clipped, so a query's output is the same sequence of operations whatever the forward
      holds (its S, C, q_offset and other rows): the blocks past its slot or of padding leave
      the running max, sum and accumulator bit-identical (exp(-1e30 - m) = 0, alpha = 1).
  """
  if impl not in IMPLEMENTATIONS:
    raise ValueError(f"attention impl {impl!r} not in {IMPLEMENTATIONS}")
  if kv_layout not in KV_LAYOUTS:
    raise ValueError(f"attention kv_layout {kv_layout!r} not in {KV_LAYOUTS}")
  b, s, g, _, d = q_BSGRD.shape
  c = k.shape[1] if kv_layout == "bcgd" else v.shape[2]
  k_shape, v_shape = ((b, c, g, d), (b, c, g, d)) if kv_layout == "bcgd" else ((b, g, d, c), (b, g, c, d))
  if k.shape != k_shape or v.shape != v_shape:
    raise ValueError(f"attention: q {q_BSGRD.shape}, k {k.shape}, v {v.shape} do not fit kv_layout={kv_layout!r}")
  if isinstance(q_offset, int) and q_offset < 0:
    raise ValueError(f"attention: q_offset {q_offset} < 0")
  if kv_valid_BC is not None and kv_valid_BC.shape != (b, c):
    raise ValueError(f"attention: kv_valid_BC {kv_valid_BC.shape} != {(b, c)}")
  backend = jax.default_backend()
  # What auto_impl reads, as the caller passed it (before the CPU cast below): tests re-resolve
  # these for another backend ("would this call reach cuDNN on a GPU?").
  impl_log.record("attention_call", impl_log.describe(
      dtype=jnp.result_type(q_BSGRD.dtype, k.dtype, v.dtype).name, layout=kv_layout, b=b, s=s, c=c,
      heads=q_BSGRD.shape[2] * q_BSGRD.shape[3], head_dim=d, static_zero_offset=_is_static_zero(q_offset),
      static_offset=isinstance(q_offset, int), causal=causal))
  if backend == "cpu" and kv_layout == "cache":
    # Scores from float32 operands: XLA:CPU has no bf16 x bf16 -> f32 dot for the cache's layout,
    # and a bf16 product is exact in float32, so the scores are the same. Elsewhere q / k keep
    # the compute dtype (a bf16 prefill at the static offset 0 reaches cuDNN on GPU).
    q_BSGRD, k = q_BSGRD.astype(jnp.float32), k.astype(jnp.float32)
  args = (q_BSGRD, k, v, kv_valid_BC, q_offset, causal, kv_layout)
  if invariant:
    impl_log.record("attention", "blocked (batch-invariant)")
    return _blocked_attention(*args, block_q=1, block_k=INVARIANT_BLOCK_K, clip=False, ordered=True)
  if impl == "flash":
    _warn_deprecated_flash()
    impl = "blocked"
  blocked = lambda *a: _blocked_attention(*a, block_q=block_q, block_k=block_k)
  native_why = native_reason(q_BSGRD, k, v, q_offset, kv_layout) if impl in ("auto", "native") else None
  if impl == "native":
    if native_why is None:
      impl_log.record("attention", "native")
      return native_causal_attention.attention(q_BSGRD, k, v, kv_valid_BC, causal=causal)
    _warn_native_once(native_why)
    impl = "auto"
  if impl == "auto":
    dtypes = {jnp.dtype(x.dtype) for x in (q_BSGRD, k, v)}
    impl = auto_impl(backend, dtypes.pop() if len(dtypes) == 1 else jnp.float32, b, s, c,
                     q_BSGRD.shape[2] * q_BSGRD.shape[3], d, static_zero_offset=_is_static_zero(q_offset),
                     static_offset=isinstance(q_offset, int), causal=causal, capability=_capability(),
                     native=native_why is None)
    if impl == "native":
      impl_log.record("attention", "native")
      return native_causal_attention.attention(q_BSGRD, k, v, kv_valid_BC, causal=causal)
  if impl == "cudnn":
    reason = _cudnn_unsupported(*args)
    if reason is None:
      impl_log.record("attention", "cudnn")
      return _cudnn_attention(*args, fallback=blocked)
    _warn_once("cudnn", reason)
    impl = "blocked"
  if impl == "splash":
    reason = _splash_unsupported(*args)
    if reason is None:
      impl_log.record("attention", "splash")
      return _splash_attention(*args)
    _warn_once("splash", reason)
    impl = "blocked"
  impl_log.record("attention", impl)
  if impl == "xla":
    return _xla_attention(*args)
  return blocked(*args)


def _warn_deprecated_flash() -> None:
  if "flash" not in _WARNED:
    _WARNED.add("flash")
    warnings.warn("attention impl 'flash' is deprecated: it is the blocked lax-loop attention, now named "
                  "'blocked' (not a fused flash kernel)", DeprecationWarning, stacklevel=3)


def native_reason(q_BSGRD, k, v, q_offset, kv_layout: str) -> str | None:
  """Why the native CPU attention cannot serve this call, or None when it can."""
  if jax.default_backend() != "cpu":
    return f"it runs on CPU only (backend {jax.default_backend()!r})"
  if kv_layout != "bcgd" or k.shape[1] != q_BSGRD.shape[1] or not _is_static_zero(q_offset):
    return "it serves the no-cache forward only (keys: the S queries themselves, q_offset the static 0)"
  if not native_causal_attention.usable_for(q_BSGRD, k, v):
    if not all(x.dtype == jnp.float32 for x in (q_BSGRD, k, v)):
      return f"it takes float32 q / k / v, got {q_BSGRD.dtype} / {k.dtype} / {v.dtype}"
    if q_BSGRD.shape[-1] > native_causal_attention.MAX_HEAD_DIM:
      return f"head dim {q_BSGRD.shape[-1]} > {native_causal_attention.MAX_HEAD_DIM}"
    return "its handlers are unavailable (RL_JAX_NATIVE_ATTENTION=0, or the build failed: see the warning)"
  return None


def _warn_native_once(reason: str) -> None:
  key = f"native: {reason}"
  if key not in _WARNED:
    _WARNED.add(key)
    warnings.warn(f"attention impl='native' falls back to auto's choice: {reason}", RuntimeWarning, stacklevel=3)


def _capability() -> tuple[int, int]:
  """The first device's CUDA compute capability ((0, 0) where it has none)."""
  capability = getattr(jax.devices()[0], "compute_capability", "0.0")
  return tuple(int(x) for x in str(capability).split(".")[:2])


_WARNED: set[str] = set()


def _warn_once(impl: str, reason: str) -> None:
  """One RuntimeWarning per (impl, reason) per process: a model traces attention once per layer."""
  key = f"{impl}: {reason}"
  if key in _WARNED:
    return
  _WARNED.add(key)
  warnings.warn(f"attention impl={impl!r} falls back to 'blocked': {reason}", RuntimeWarning, stacklevel=3)


def _is_static_zero(q_offset) -> bool:
  return isinstance(q_offset, int) and q_offset == 0


def _to_bgcd(k, v, kv_layout: str):
  """Keys and values as [B, G, C, D] (blocked's and splash's layout)."""
  if kv_layout == "bcgd":
    return jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
  return jnp.swapaxes(k, 2, 3), v


# ---------------------------------------------------------------------------------------------
# xla: the model's attention before this module (layers.py), unchanged.

def _attend(q_BSGRD, k, v, mask_BSC, k_axes: str, v_axes: str):
  """softmax(q k^T / sqrt(D), masked) v for keys / values laid out as `k_axes` / `v_axes` (einsum letters)."""
  hd = q_BSGRD.shape[-1]
  scores_BGRSC = jnp.einsum(f"bsgrd,{k_axes}->bgrsc", q_BSGRD, k,
                            preferred_element_type=jnp.float32) * (hd ** -0.5)
  scores_BGRSC = jnp.where(mask_BSC[:, None, None, :, :], scores_BGRSC, MASK_VALUE)
  probs_BGRSC = jax.nn.softmax(scores_BGRSC, axis=-1).astype(v.dtype)
  return jnp.einsum(f"bgrsc,{v_axes}->bsgrd", probs_BGRSC, v)


# Causal attention over S tokens in query blocks of at least this many tokens (up to
# _MAX_QUERY_BLOCKS): block i reads only the keys up to its last query, skipping the masked
# upper triangle. Dense train step of issue 15 (S = 160, 4 blocks of 40), one layer's
# attention forward + backward: 286 -> 168 ms on the 2-core box; below 2 blocks' worth of
# tokens, one block.
_MIN_QUERY_BLOCK = 32
_MAX_QUERY_BLOCKS = 4


def query_blocks(s: int) -> list[tuple[int, int]]:
  """[start, end) of each causal query block over S tokens (`_causal_attention`)."""
  n = max(1, min(_MAX_QUERY_BLOCKS, s // _MIN_QUERY_BLOCK))
  size = -(-s // n)
  return [(start, min(start + size, s)) for start in range(0, s, size)]


def _causal_attention(q_BSGRD, k_BSGD, v_BSGD, mask_BSC):
  """`_attend` over the S tokens themselves, block by block; `mask_BSC` must be causal.

  Exact for every query with at least one visible key: the skipped keys are masked for
  the whole block, and a masked key's weight is exp(-1e30 - max) = 0. A query that sees no
  key at all (a padding token with only padding before it) averages v over its block's
  keys instead of all S: a value nothing reads.
  """
  outs = []
  for start, end in query_blocks(q_BSGRD.shape[1]):
    outs.append(_attend(q_BSGRD[:, start:end], k_BSGD[:, :end], v_BSGD[:, :end],
                        mask_BSC[:, start:end, :end], "bcgd", "bcgd"))
  return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)


def _xla_attention(q_BSGRD, k, v, kv_valid_BC, q_offset, causal, kv_layout):
  """Today's path: builds the dense mask_BSC the model builds today and calls today's code."""
  b, s = q_BSGRD.shape[:2]
  c = k.shape[1] if kv_layout == "bcgd" else v.shape[2]
  valid_BC = jnp.ones((b, c), bool) if kv_valid_BC is None else kv_valid_BC
  if causal and kv_layout == "bcgd" and s == c and _is_static_zero(q_offset):
    mask_BSC = jnp.tril(jnp.ones((s, s), bool))[None] & valid_BC[:, None, :]
    return _causal_attention(q_BSGRD, k, v, mask_BSC)
  slots_C = jnp.arange(c)
  if causal:
    q_slots_BS = jnp.reshape(q_offset, (-1, 1)) + jnp.arange(s)  # [1, S], or [B, S] per row
    mask_BSC = (slots_C[None, None, :] <= q_slots_BS[:, :, None]) & valid_BC[:, None, :]
  else:
    mask_BSC = jnp.broadcast_to(valid_BC[:, None, :], (b, s, c))
  axes = ("bcgd", "bcgd") if kv_layout == "bcgd" else ("bgdc", "bgcd")
  return _attend(q_BSGRD, k, v, mask_BSC, *axes)


# ---------------------------------------------------------------------------------------------
# blocked: online softmax over query x key blocks in lax loops, backward recomputes the blocks.
#
# Internal layout: queries as rows of [B, G, Q, D], Q = S_pad * R, row = s * R + r (the R heads
# of one kv group share every key block they read); keys / values [B, G, C_pad, D]; S and C
# padded to whole blocks (padded keys masked, padded query rows dropped).

@dataclasses.dataclass(frozen=True)
class _Blocks:
  bq: int  # query slots per block (a block holds bq * r rows)
  bk: int  # key slots per block
  r: int
  nq: int
  nk: int
  causal: bool
  ordered: bool = False  # the batch-invariant mode: products as fixed-order loops (`_qk`, `_pv`)


def _qk(q_BGQD, k_BGKD, ordered: bool):
  """f32 scores q k^T of one block; `ordered`: accumulated over D in index order, elementwise (a
  dot's XLA:CPU kernel, and so its rounding, depends on the shapes around it: rl_jax/ops/batch_invariant.py)."""
  if not ordered:
    return jnp.einsum("bgqd,bgkd->bgqk", q_BGQD, k_BGKD, preferred_element_type=jnp.float32)
  q, k = q_BGQD.astype(jnp.float32), k_BGKD.astype(jnp.float32)
  return ordered_sum(lambda i: q[..., i, None] * k[..., None, :, i], q.shape[-1])


def _pv(p_BGQK, v_BGKD, ordered: bool):
  """f32 p v of one block; `ordered`: accumulated over the block's keys in index order."""
  if not ordered:
    return jnp.einsum("bgqk,bgkd->bgqd", p_BGQK, v_BGKD, preferred_element_type=jnp.float32)
  p, v = p_BGQK.astype(jnp.float32), v_BGKD.astype(jnp.float32)
  return ordered_sum(lambda i: p[..., i, None] * v[..., None, i, :], p.shape[-1])


def _key_block_end(i, q_offset, spec: _Blocks):
  """Key blocks [0, end) query block i reads: those starting at or before its last slot."""
  if not spec.causal:
    return spec.nk
  return jnp.clip((q_offset + (i + 1) * spec.bq - 1) // spec.bk + 1, 0, spec.nk)


def _query_block_start(j, q_offset, spec: _Blocks):
  """Query blocks [start, nq) that read key block j (the inverse of _key_block_end)."""
  if not spec.causal:
    return 0
  return jnp.clip((j * spec.bk - q_offset) // spec.bq, 0, spec.nq)


def _block_scores(q_BGQD, k_BGKD, valid_BK, i, j, q_offset, spec: _Blocks):
  """Masked f32 scores of query block i x key block j and their mask (True = attended)."""
  hd = q_BGQD.shape[-1]
  s_BGQK = _qk(q_BGQD, k_BGKD, spec.ordered) * (hd ** -0.5)
  mask_B1QK = valid_BK[:, None, None, :]
  if spec.causal:
    q_slot_BQ = jnp.reshape(q_offset, (-1, 1)) + i * spec.bq + jnp.arange(spec.bq * spec.r) // spec.r
    k_slot_K = j * spec.bk + jnp.arange(spec.bk)
    mask_B1QK = mask_B1QK & (k_slot_K[None, None, :] <= q_slot_BQ[:, :, None])[:, None]
  return jnp.where(mask_B1QK, s_BGQK, MASK_VALUE), mask_B1QK


def _blocked_forward(q_BGQD, k_BGCD, v_BGCD, valid_BC, q_offset, spec: _Blocks):
  """(out_BGQD in v's dtype, running max m_BGQ, running sum l_BGQ), f32 statistics."""
  f32 = jnp.float32
  b, g = q_BGQD.shape[:2]
  rows = spec.bq * spec.r

  def query_block(i):
    q_blk = lax.dynamic_slice_in_dim(q_BGQD, i * rows, rows, axis=2)

    end = _key_block_end(i, q_offset, spec)  # [B] with per-row offsets

    def key_block(j, carry):
      m_BGQ, l_BGQ, acc_BGQD = carry
      k_blk = lax.dynamic_slice_in_dim(k_BGCD, j * spec.bk, spec.bk, axis=2)
      v_blk = lax.dynamic_slice_in_dim(v_BGCD, j * spec.bk, spec.bk, axis=2)
      valid_BK = lax.dynamic_slice_in_dim(valid_BC, j * spec.bk, spec.bk, axis=1)
      s_BGQK, _ = _block_scores(q_blk, k_blk, valid_BK, i, j, q_offset, spec)
      m_new = jnp.maximum(m_BGQ, jnp.max(s_BGQK, axis=-1))
      alpha = jnp.exp(m_BGQ - m_new)  # finite: m starts at the (finite) mask value
      p_BGQK = jnp.exp(s_BGQK - m_new[..., None])
      l_BGQ = alpha * l_BGQ + jnp.sum(p_BGQK, axis=-1)
      # As _attend: the probabilities meet v in v's dtype, accumulated in float32.
      pv = _pv(p_BGQK.astype(v_BGCD.dtype), v_blk, spec.ordered)
      new = (m_new, l_BGQ, alpha[..., None] * acc_BGQD + pv)
      if jnp.ndim(end) == 0:
        return new
      # Per-row offsets: the loop runs to the furthest row's end; a row past its own end keeps
      # its carry, so each row computes exactly what a call with its offset alone computes (a
      # fully masked block is a no-op only for a query that has seen a key).
      keep_B = j >= end
      return tuple(jnp.where(keep_B.reshape((-1,) + (1,) * (x.ndim - 1)), x, y) for x, y in zip(carry, new))

    # *_like: the accumulators inherit q's sharding (a mesh with Explicit axes needs it).
    init = (jnp.full_like(q_blk[..., 0], MASK_VALUE, f32), jnp.zeros_like(q_blk[..., 0], f32),
            jnp.zeros_like(q_blk, f32))
    # Every query block reads key block 0 (q_offset >= 0), so l >= 1: no division by zero.
    m_BGQ, l_BGQ, acc_BGQD = lax.fori_loop(0, end if jnp.ndim(end) == 0 else jnp.max(end), key_block, init)
    return (acc_BGQD / l_BGQ[..., None]).astype(v_BGCD.dtype), m_BGQ, l_BGQ

  out_nBGQD, m_nBGQ, l_nBGQ = lax.map(query_block, jnp.arange(spec.nq))
  join = lambda x: jnp.moveaxis(x, 0, 2).reshape(b, g, spec.nq * rows, *x.shape[4:])
  return join(out_nBGQD), join(m_nBGQ), join(l_nBGQ)


def _blocked_backward(q_BGQD, k_BGCD, v_BGCD, valid_BC, q_offset, out_BGQD, m_BGQ, l_BGQ, dout_BGQD,
                    spec: _Blocks):
  """(dq, dk, dv) in the inputs' dtypes: outer loop over key blocks (dk, dv of block j in the
  carry), inner over the query blocks that read it (dq accumulated in place), all in f32."""
  if jnp.ndim(q_offset):
    raise NotImplementedError("blocked attention's backward takes one q_offset for every row (per-row "
                              "offsets are the continuous engine's prefill, never differentiated)")
  f32 = jnp.float32
  b, g, _, d = q_BGQD.shape
  rows, scale = spec.bq * spec.r, d ** -0.5
  dout_BGQD = dout_BGQD.astype(f32)
  delta_BGQ = jnp.sum(dout_BGQD * out_BGQD.astype(f32), axis=-1)  # rowsum(dO * O)
  inv_l_BGQ = 1.0 / l_BGQ

  def key_block(dq_BGQD, j):
    k_blk = lax.dynamic_slice_in_dim(k_BGCD, j * spec.bk, spec.bk, axis=2)
    v_blk = lax.dynamic_slice_in_dim(v_BGCD, j * spec.bk, spec.bk, axis=2).astype(f32)
    valid_BK = lax.dynamic_slice_in_dim(valid_BC, j * spec.bk, spec.bk, axis=1)
    k32 = k_blk.astype(f32)

    def query_block(i, carry):
      dq_BGQD, dk_BGKD, dv_BGKD = carry
      at = lambda x: lax.dynamic_slice_in_dim(x, i * rows, rows, axis=2)
      q_blk, do_blk = at(q_BGQD), at(dout_BGQD)
      s_BGQK, mask_B1QK = _block_scores(q_blk, k_blk, valid_BK, i, j, q_offset, spec)
      # P exactly as the forward normalized it: exp(s - m) / l, also for a row with no
      # visible key (uniform weights), where exp(s - logsumexp) would round to 1, not 1/l.
      p_BGQK = jnp.exp(s_BGQK - at(m_BGQ)[..., None]) * at(inv_l_BGQ)[..., None]
      dv_BGKD = dv_BGKD + jnp.einsum("bgqk,bgqd->bgkd", p_BGQK, do_blk)
      dp_BGQK = jnp.einsum("bgqd,bgkd->bgqk", do_blk, v_blk)
      # A masked score is the constant -1e30: no gradient reaches q or k through it.
      ds_BGQK = jnp.where(mask_B1QK, p_BGQK * (dp_BGQK - at(delta_BGQ)[..., None]), 0.0)
      dq_blk = jnp.einsum("bgqk,bgkd->bgqd", ds_BGQK, k32) * scale
      dq_BGQD = lax.dynamic_update_slice_in_dim(dq_BGQD, at(dq_BGQD) + dq_blk, i * rows, axis=2)
      dk_BGKD = dk_BGKD + jnp.einsum("bgqk,bgqd->bgkd", ds_BGQK, q_blk.astype(f32)) * scale
      return dq_BGQD, dk_BGKD, dv_BGKD

    zeros = jnp.zeros_like(k32)
    dq_BGQD, dk_BGKD, dv_BGKD = lax.fori_loop(_query_block_start(j, q_offset, spec), spec.nq, query_block,
                                              (dq_BGQD, zeros, zeros))
    return dq_BGQD, (dk_BGKD, dv_BGKD)

  dq_BGQD, (dk_nBGKD, dv_nBGKD) = lax.scan(key_block, jnp.zeros_like(q_BGQD, f32), jnp.arange(spec.nk))
  join = lambda x: jnp.moveaxis(x, 0, 2).reshape(b, g, spec.nk * spec.bk, d)
  return (dq_BGQD.astype(q_BGQD.dtype), join(dk_nBGKD).astype(k_BGCD.dtype),
          join(dv_nBGKD).astype(v_BGCD.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _blocked_core(q_BGQD, k_BGCD, v_BGCD, valid_BC, q_offset, spec: _Blocks):
  return _blocked_forward(q_BGQD, k_BGCD, v_BGCD, valid_BC, q_offset, spec)[0]


def _blocked_core_fwd(q_BGQD, k_BGCD, v_BGCD, valid_BC, q_offset, spec: _Blocks):
  # Residuals: the inputs, the output and two f32 numbers per query row: O(S * D), never S x C.
  out_BGQD, m_BGQ, l_BGQ = _blocked_forward(q_BGQD, k_BGCD, v_BGCD, valid_BC, q_offset, spec)
  return out_BGQD, (q_BGQD, k_BGCD, v_BGCD, valid_BC, q_offset, out_BGQD, m_BGQ, l_BGQ)


def _blocked_core_bwd(spec: _Blocks, res, dout_BGQD):
  q_BGQD, k_BGCD, v_BGCD, valid_BC, q_offset, out_BGQD, m_BGQ, l_BGQ = res
  dq, dk, dv = _blocked_backward(q_BGQD, k_BGCD, v_BGCD, valid_BC, q_offset, out_BGQD, m_BGQ, l_BGQ,
                               dout_BGQD, spec)
  return dq, dk, dv, None, None  # no cotangent for the mask and the offset (integers)


_blocked_core.defvjp(_blocked_core_fwd, _blocked_core_bwd)


def _blocked_attention(q_BSGRD, k, v, kv_valid_BC, q_offset, causal, kv_layout, *, block_q: int, block_k: int,
                     clip: bool = True, ordered: bool = False):
  """Pads S and C to whole blocks, lays the operands out as _blocked_core reads them, and back.
  `clip=False` keeps the block sizes as given where S or C is smaller, and `ordered` computes the
  forward's products as fixed-order loops (both: the batch-invariant mode)."""
  b, s, g, r, d = q_BSGRD.shape
  k_BGCD, v_BGCD = _to_bgcd(k, v, kv_layout)
  c = k_BGCD.shape[2]
  bq, bk = (max(1, min(block_q, s)), max(1, min(block_k, c))) if clip else (block_q, block_k)
  spec = _Blocks(bq=bq, bk=bk, r=r, nq=-(-s // bq), nk=-(-c // bk), causal=causal, ordered=ordered)
  s_pad, c_pad = spec.nq * bq - s, spec.nk * bk - c
  q_BGSRD = jnp.pad(jnp.transpose(q_BSGRD, (0, 2, 1, 3, 4)), ((0, 0), (0, 0), (0, s_pad), (0, 0), (0, 0)))
  pad_c = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, c_pad), (0, 0)))
  valid_BC = jnp.ones((b, c), bool) if kv_valid_BC is None else kv_valid_BC.astype(bool)
  valid_BC = jnp.pad(valid_BC, ((0, 0), (0, c_pad)))  # padded key slots: never valid
  out_BGQD = _blocked_core(q_BGSRD.reshape(b, g, (s + s_pad) * r, d), pad_c(k_BGCD), pad_c(v_BGCD), valid_BC,
                         jnp.asarray(q_offset, jnp.int32), spec)
  out_BGSRD = out_BGQD.reshape(b, g, s + s_pad, r, d)[:, :, :s]
  return jnp.transpose(out_BGSRD, (0, 2, 1, 3, 4))


# ---------------------------------------------------------------------------------------------
# cudnn

def cudnn_reason(dtype, head_dim: int, static_zero_offset: bool, causal: bool,
                 capability: tuple[int, int]) -> str | None:
  """Why cuDNN attention cannot take q / k / v of `dtype` (one dtype for all three) on a GPU."""
  if dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"cuDNN flash attention takes bf16 / fp16 q, k, v of one dtype (got {dtype})"
  d_max = 256 if tuple(capability) >= (9, 0) else 128
  if head_dim % 8 or head_dim > d_max:
    return f"cuDNN needs a head dim that is a multiple of 8 and <= {d_max} (got {head_dim})"
  if causal and not static_zero_offset:
    return "cuDNN's causal mask is top-left aligned: q_offset must be the static 0 (got a shifted or traced offset)"
  return None


def _cudnn_unsupported(q_BSGRD, k, v, kv_valid_BC, q_offset, causal, kv_layout) -> str | None:
  """Why jax.nn.dot_product_attention(implementation='cudnn') cannot run these inputs (None: it can)."""
  del kv_valid_BC, kv_layout  # any per-row mask: contiguous rows run, the rest go to blocked (lax.cond)
  backend = jax.default_backend()
  if backend != "gpu":
    return f"cuDNN needs a GPU backend (this backend is {backend!r})"
  dtypes = {jnp.dtype(x.dtype) for x in (q_BSGRD, k, v)}
  if len(dtypes) != 1:
    return f"cuDNN flash attention takes bf16 / fp16 q, k, v of one dtype (got {q_BSGRD.dtype}, {k.dtype}, {v.dtype})"
  return cudnn_reason(dtypes.pop(), q_BSGRD.shape[-1], _is_static_zero(q_offset), causal, _capability())


def _contiguous_runs(valid_BC):
  """(start_B, end_B, ok): each row's valid slots are [start, end) and no row is empty, iff ok."""
  c = valid_BC.shape[1]
  start_B = jnp.argmax(valid_BC, axis=1).astype(jnp.int32)
  end_B = (c - jnp.argmax(valid_BC[:, ::-1], axis=1)).astype(jnp.int32)
  count_B = jnp.sum(valid_BC, axis=1, dtype=jnp.int32)
  return start_B, end_B, jnp.all((count_B > 0) & (end_B - start_B == count_B))


def _roll_rows(x_BS_, shift_B):
  """Row b rotated left by shift_B[b] along axis 1: out[b, i] = x[b, (i + shift_b) % S]."""
  s = x_BS_.shape[1]
  idx_BS = (jnp.arange(s)[None, :] + shift_B[:, None]) % s
  return jnp.take_along_axis(x_BS_, idx_BS.reshape(idx_BS.shape + (1,) * (x_BS_.ndim - 2)), axis=1)


def _cudnn_attention(q_BSGRD, k, v, kv_valid_BC, q_offset, causal, kv_layout, *, fallback, sdpa_impl="cudnn"):
  """cuDNN attention; `sdpa_impl="xla"` runs the same wiring through jax's XLA reference (tests, on CPU)."""
  del q_offset  # the static 0 (_cudnn_unsupported)
  b, s, g, r, d = q_BSGRD.shape
  if kv_layout == "bcgd":
    k_BCGD, v_BCGD = k, v
  else:
    k_BCGD, v_BCGD = jnp.transpose(k, (0, 3, 1, 2)), jnp.swapaxes(v, 1, 2)
  sdpa = functools.partial(jax.nn.dot_product_attention, is_causal=causal, implementation=sdpa_impl)
  q_BSHD = q_BSGRD.reshape(b, s, g * r, d)  # head h = g * R + r, as jax's GQA grouping
  if kv_valid_BC is None:
    return sdpa(q_BSHD, k_BCGD, v_BCGD).reshape(b, s, g, r, d).astype(v.dtype)
  start_B, end_B, ok = _contiguous_runs(kv_valid_BC.astype(bool))

  def run_cudnn(q_BSHD, k_BCGD, v_BCGD):
    # Rotating queries and keys alike by `start` keeps `key slot <= query slot` among real
    # tokens and makes each row's run [0, end - start): the right padding cuDNN's sequence
    # lengths express. Queries before `start` (they see no key) wrap past q_seqlen.
    q_rot = _roll_rows(q_BSHD, start_B) if causal else q_BSHD
    out_rot = sdpa(q_rot, _roll_rows(k_BCGD, start_B), _roll_rows(v_BCGD, start_B),
                   query_seq_lengths=(s - start_B) if causal else None, key_value_seq_lengths=end_B - start_B)
    out_BSHD = _roll_rows(out_rot, -start_B) if causal else out_rot
    seen_BS = (jnp.arange(s)[None, :] >= start_B[:, None]) if causal else jnp.ones((b, s), bool)
    # cuDNN's rows past q_seqlen are not guaranteed written: 0 keeps them (and their gradient) finite.
    return jnp.where(seen_BS[:, :, None, None], out_BSHD, 0).astype(v.dtype)

  def run_blocked(q_BSHD, k_BCGD, v_BCGD):
    return fallback(q_BSHD.reshape(b, s, g, r, d), k_BCGD, v_BCGD, kv_valid_BC, 0, causal,
                 "bcgd").reshape(b, s, g * r, d).astype(v.dtype)

  out_BSHD = lax.cond(ok, run_cudnn, run_blocked, q_BSHD, k_BCGD, v_BCGD)
  return out_BSHD.reshape(b, s, g, r, d)


# ---------------------------------------------------------------------------------------------
# splash (TPU)

_SPLASH_LANES = 128  # the kernel's key-block granularity (block_kv_compute % 128 == 0)


def _splash_unsupported(q_BSGRD, k, v, kv_valid_BC, q_offset, causal, kv_layout) -> str | None:
  """Why the TPU splash kernel cannot run these inputs (None: it can)."""
  del q_BSGRD, k, v, kv_valid_BC, kv_layout
  backend = jax.default_backend()
  if backend != "tpu":
    return f"splash attention is a TPU kernel (this backend is {backend!r})"
  if causal and not isinstance(q_offset, int):
    return "splash's CausalMask takes a static offset: q_offset must be a Python int (got a traced one)"
  return None


def _splash_attention(q_BSGRD, k, v, kv_valid_BC, q_offset, causal, kv_layout, *, interpret: bool = False):
  """The splash kernel vmapped over rows; `interpret=True` runs the Pallas interpreter (tests)."""
  # Lazy: Pallas TPU is not needed (nor always importable) on CPU / GPU.
  from jax.experimental.pallas.ops.tpu import splash_attention as sa  # pylint: disable=g-import-not-at-top
  b, s, g, r, d = q_BSGRD.shape
  k_BGCD, v_BGCD = _to_bgcd(k, v, kv_layout)
  c = k_BGCD.shape[2]
  up = lambda n: -(-n // _SPLASH_LANES) * _SPLASH_LANES
  s_p, c_p = up(s), up(c)
  block = lambda n: next(x for x in (512, 256, 128) if n % x == 0)
  bq, bk = block(s_p), block(c_p)
  # The kernel does not scale the logits: q / sqrt(D) beforehand, rounded to q's dtype.
  q_BHSD = (jnp.transpose(q_BSGRD, (0, 2, 3, 1, 4)).astype(jnp.float32) * d ** -0.5).astype(q_BSGRD.dtype)
  q_BHSD = jnp.pad(q_BHSD.reshape(b, g * r, s, d), ((0, 0), (0, 0), (0, s_p - s), (0, 0)))
  pad_c = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, c_p - c), (0, 0)))
  valid_BC = jnp.ones((b, c), bool) if kv_valid_BC is None else kv_valid_BC.astype(bool)
  valid_BC = jnp.pad(valid_BC, ((0, 0), (0, c_p - c)))
  # Key mask as segment ids: every query is segment 0, a valid key 0, a padding key 1.
  segments = sa.SegmentIds(q=jnp.zeros((b, s_p), jnp.int32), kv=jnp.where(valid_BC, 0, 1).astype(jnp.int32))
  head_mask = sa.CausalMask((s_p, c_p), offset=q_offset) if causal else sa.FullMask((s_p, c_p))
  sizes = sa.BlockSizes(block_q=bq, block_kv=bk, block_kv_compute=bk, block_q_dkv=bq, block_kv_dkv=bk,
                        block_kv_dkv_compute=bk, block_q_dq=bq, block_kv_dq=bk)
  # GQA in the MHA kernel: q head h reads kv head h // R (h = g * R + r).
  kernel = sa.make_splash_mha(sa.MultiHeadMask([head_mask] * (g * r)), block_sizes=sizes, head_shards=1,
                              q_seq_shards=1, interpret=interpret)
  out_BHSD = jax.vmap(kernel)(q_BHSD, pad_c(k_BGCD), pad_c(v_BGCD), segments)
  out_BGRSD = out_BHSD[:, :, :s].reshape(b, g, r, s, d)
  return jnp.transpose(out_BGRSD, (0, 3, 1, 2, 4)).astype(v.dtype)
