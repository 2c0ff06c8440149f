"""The trainer's attention on CPU as a native forward and backward (XLA FFI handlers built on first use)."""
from __future__ import annotations

import functools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from rl_jax.ops import native_build

# The no-cache forward over S tokens (the update, the p_old forward, SFT, evaluation's teacher
# forcing) ran as XLA:CPU's separate passes: two batched dots, the mask and a softmax of several
# reductions over f32 [B, G, R, S, S] scores, plus copies of q / k / v to (b, g)-major layouts
# (docs/performance.md: 291 ms of a 1.15 s dense update against torch's fused 82 ms). The handlers
# (ops/native/causal_attention_cpu.cc) take one (row, kv head) at a time in the model's own layout,
# keep its scores in the thread's scratch, and save two floats per query (the row max and sum) for
# the backward, which recomputes the probabilities. Same build and cache as the decode attention
# (`native_build`); RL_JAX_NATIVE_ATTENTION=0 keeps XLA's computation for both.

FWD_TARGET = "rl_jax_causal_attention_fwd_f32"
BWD_TARGET = "rl_jax_causal_attention_bwd_f32"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native", "causal_attention_cpu.cc")
ENV_DISABLE = "RL_JAX_NATIVE_ATTENTION"
# The batch axes a device's rows are split over (rl_jax.sharding.BATCH_AXES; not imported: the ops
# package does not depend on the jobs' modules).
_BATCH_AXES = ("data", "fsdp", "expert")


@functools.lru_cache(maxsize=None)
def available() -> bool:
  """Whether both handlers are built and registered for the CPU platform (once per process); False,
  with one warning, when they cannot be built, and False when RL_JAX_NATIVE_ATTENTION=0."""
  what, fallback = "the native training attention", "attending with XLA's dots"
  return all(native_build.register(SOURCE, symbol, target, what=what, fallback=fallback, env_disable=ENV_DISABLE)
             for symbol, target in (("RlJaxCausalAttentionFwdF32", FWD_TARGET),
                                    ("RlJaxCausalAttentionBwdF32", BWD_TARGET)))


MAX_HEAD_DIM = 256  # the handlers keep a query's head dim in registers / on the stack (kMaxHeadDim)


def usable_for(q_BSGRD: jax.Array, k_BSGD: jax.Array, v_BSGD: jax.Array) -> bool:
  """Whether `attention` serves these operands here: float32, head dim <= 256, traced for the CPU
  backend, the handlers available."""
  return (all(a.dtype == jnp.float32 for a in (q_BSGRD, k_BSGD, v_BSGD)) and q_BSGRD.shape[-1] <= MAX_HEAD_DIM
          and jax.default_backend() == "cpu" and available())


def attention(q_BSGRD: jax.Array, k_BSGD: jax.Array, v_BSGD: jax.Array, valid_BS: jax.Array | None = None,
              *, causal: bool = True) -> jax.Array:
  """softmax(where(mask, q k^T / sqrt(D), -1e30)) v over the S tokens themselves -> out_BSGRD float32.

  Query s reads key c iff valid_BS[b, c] and (not causal or c <= s); one that reads none averages v
  over the keys it visits (c <= s). Differentiable (custom VJP: dq, dk, dv; none for the mask).
  Under a context mesh (`jax.set_mesh`) whose batch axes split B, each device runs its own rows.
  """
  b, s, g, _, d = q_BSGRD.shape
  if k_BSGD.shape != (b, s, g, d) or v_BSGD.shape != (b, s, g, d):
    raise ValueError(f"native attention: k {k_BSGD.shape} and v {v_BSGD.shape} must be {(b, s, g, d)} "
                     f"for q_BSGRD {q_BSGRD.shape}")
  valid_BS = jnp.ones((b, s), bool) if valid_BS is None else valid_BS
  if valid_BS.shape != (b, s) or valid_BS.dtype != jnp.bool_:
    raise ValueError(f"native attention: valid_BS must be bool {(b, s)}, got {valid_BS.dtype} {valid_BS.shape}")
  return _core(q_BSGRD, k_BSGD, v_BSGD, valid_BS, float(d ** -0.5), bool(causal))


def _per_device(fn, b: int, n_in: int):
  """`fn` under a shard_map over the context mesh's batch axes that split B (manual inside one
  already excluded), else `fn`: a custom call the partitioner cannot split would be computed whole
  on every device from gathered operands. The rows are independent, so the result is the same."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return fn
  axes = tuple(a for a in _BATCH_AXES if a in mesh.axis_names and mesh.shape[a] > 1 and a not in mesh.manual_axes)
  if not axes or b % math.prod(mesh.shape[a] for a in axes):
    return fn
  spec = P(axes)
  return jax.shard_map(fn, in_specs=(spec,) * n_in, out_specs=spec, axis_names=set(axes), check_vma=False)


def _forward(q, k, v, valid, scale, causal):
  def run(q, k, v, valid):  # result shapes from the operands it sees (a device's rows under shard_map)
    stat = jax.ShapeDtypeStruct(q.shape[:-1], jnp.float32)
    call = jax.ffi.ffi_call(FWD_TARGET, (jax.ShapeDtypeStruct(q.shape, jnp.float32), stat, stat),
                            vmap_method="broadcast_all")
    return call(q, k, v, valid, scale=np.float32(scale), causal=causal)
  return _per_device(run, q.shape[0], 4)(q, k, v, valid)


def _backward(q, k, v, valid, out, m, l, dout, scale, causal):
  def run(q, k, v, *rest):
    call = jax.ffi.ffi_call(BWD_TARGET, tuple(jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in (q, k, v)),
                            vmap_method="broadcast_all")
    return call(q, k, v, *rest, scale=np.float32(scale), causal=causal)
  return _per_device(run, q.shape[0], 8)(q, k, v, valid, out, m, l, dout)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _core(q, k, v, valid, scale, causal):
  return _forward(q, k, v, valid, scale, causal)[0]


def _core_fwd(q, k, v, valid, scale, causal):
  # Residuals: the inputs, the output and two floats per query: O(S * D), never S x S.
  out, m, l = _forward(q, k, v, valid, scale, causal)
  return out, (q, k, v, valid, out, m, l)


def _core_bwd(scale, causal, res, dout):
  q, k, v, valid, out, m, l = res
  dq, dk, dv = _backward(q, k, v, valid, out, m, l, dout.astype(jnp.float32), scale, causal)
  return dq, dk, dv, None  # no cotangent for the mask


_core.defvjp(_core_fwd, _core_bwd)
