"""A native decode attention for the sampler on CPU: an XLA FFI handler built from source on first use."""
from __future__ import annotations

import contextvars
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from rl_jax.ops import native_build

# A decode step attends one query token per row to the KV cache. XLA:CPU runs its two batched
# matmuls (`[R, D] x [D, C]` and `[R, C] x [C, D]` per row and kv head) as a loop of small products
# at a few microseconds each: on the peer benchmark's dense model they took 62% of a decode step
# (docs/performance.md). The handler (ops/native/decode_attention_cpu.cc) reads each (row, kv head)'s
# keys and values once, with the mask and softmax in the same pass, on XLA's intra-op threads.
# Same build and cache as the native top-k (`native_build`); RL_JAX_NATIVE_ATTENTION=0 keeps XLA's.

TARGET = "rl_jax_decode_attention_f32"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native", "decode_attention_cpu.cc")
ENV_DISABLE = "RL_JAX_NATIVE_ATTENTION"
# Set while a program for a mesh of several devices traces (`per_mesh`).
_SHARDED = contextvars.ContextVar("rl_jax_native_attention_sharded", default=False)


def build(path: str | None = None) -> str:
  """Compiles the handler to `path` (default: the cache's) unless it is there; returns the path."""
  return native_build.build(SOURCE, path, what="the native decode attention")


@functools.lru_cache(maxsize=None)
def available() -> bool:
  """Whether the handler is built and registered for the CPU platform (once per process); False, with
  one warning, when it cannot be built, and False when RL_JAX_NATIVE_ATTENTION=0."""
  return native_build.register(SOURCE, "RlJaxDecodeAttentionF32", TARGET, what="the native decode attention",
                               fallback="attending with XLA's dots", env_disable=ENV_DISABLE)


def decode_attention(q_BGRD: jax.Array, kT_BGDC: jax.Array, v_BGCD: jax.Array, mask_BC: jax.Array,
                     scale: float) -> jax.Array:
  """softmax(where(mask, q kT * scale, -1e30)) v -> `[B, G, R, D]` float32, through the handler
  (`available()` first); B may be several leading axes (under vmap, the mapped axes join them)."""
  b, (g, r, d), c = q_BGRD.shape[:-3], q_BGRD.shape[-3:], kT_BGDC.shape[-1]
  want = {"kT_BGDC": (*b, g, d, c), "v_BGCD": (*b, g, c, d), "mask_BC": (*b, c)}
  for name, x in (("kT_BGDC", kT_BGDC), ("v_BGCD", v_BGCD), ("mask_BC", mask_BC)):
    if x.shape != want[name]:
      raise ValueError(f"native decode_attention: {name} has shape {x.shape}, want {want[name]} "
                       f"for q_BGRD {q_BGRD.shape}")
  if not all(x.dtype == jnp.float32 for x in (q_BGRD, kT_BGDC, v_BGCD)) or mask_BC.dtype != jnp.bool_:
    raise TypeError("native decode_attention takes float32 q, kT, v and a bool mask, got "
                    f"{q_BGRD.dtype}, {kT_BGDC.dtype}, {v_BGCD.dtype}, {mask_BC.dtype}")
  call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q_BGRD.shape, jnp.float32), vmap_method="broadcast_all")
  return call(q_BGRD, kT_BGDC, v_BGCD, mask_BC, scale=np.float32(scale))


def usable_for(*arrays: jax.Array) -> bool:
  """Whether `decode_attention` serves these operands here: all float32, traced for the CPU backend,
  not inside a program for several devices (`per_mesh`), the handler available."""
  return (all(a.dtype == jnp.float32 for a in arrays) and jax.default_backend() == "cpu"
          and not _SHARDED.get() and available())


def per_mesh(program):
  """Decorates a program that takes a `mesh` keyword: traced with the handler off when the mesh
  spans several devices. The partitioner knows nothing of the custom call's rows and would gather
  every layer's KV cache to each device for it; XLA's dots partition along the batch."""
  @functools.wraps(program)
  def traced(*args, mesh, **kwargs):
    token = _SHARDED.set(_SHARDED.get() or (mesh is not None and mesh.size > 1))
    try:
      return program(*args, mesh=mesh, **kwargs)
    finally:
      _SHARDED.reset(token)
  return traced
