"""A native exact top-k for the sampler's recording on CPU: an XLA FFI handler built from source on first use."""
from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from rl_jax.ops import native_build

# XLA:CPU runs `lax.top_k` as one custom call with a k-heap per row: ~1.5 ms at [32, 4096], k = 128,
# which made recording the top-k cost 17-27% of a decode step of the peer benchmark's models. The
# handler (native/topk_cpu.cc) returns the same bits (values, ids, tie order, -0.0, NaNs) from a
# selection over the elements above a lower bound, in ~0.2 ms; recording then costs +1% to +7% of a
# decode step, every row's 95% interval below 10% (docs/performance.md). It is compiled with the
# system's C++ compiler against jaxlib's FFI headers into a per-user cache the first time it is
# needed, keyed by the source, jax's version and headers' path and the Python ABI; without a
# compiler, or with RL_JAX_NATIVE_TOPK=0, `lax.top_k` serves.

TARGET = "rl_jax_topk_f32"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native", "topk_cpu.cc")
ENV_DISABLE = "RL_JAX_NATIVE_TOPK"


def _library_path() -> str:
  return native_build.library_path(SOURCE)


def build(path: str | None = None) -> str:
  """Compiles the handler to `path` (default: the cache's) unless it is there; returns the path
  (`native_build.build`: RuntimeError naming the compiler's output when the build fails)."""
  return native_build.build(SOURCE, path, what="the native top-k")


@functools.lru_cache(maxsize=None)
def available() -> bool:
  """Whether the handler is built and registered for the CPU platform (once per process); False, with
  one warning, when it cannot be built, and False when RL_JAX_NATIVE_TOPK=0."""
  # Rows are independent: a sharded sampler's batch stays sharded through the call.
  return native_build.register(SOURCE, "RlJaxTopKF32", TARGET, what="the native top-k",
                               fallback="recording with lax.top_k", env_disable=ENV_DISABLE,
                               batch_partitionable=True)


def top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """`lax.top_k(x, k)` of a float32 array, bit for bit, through the native handler (`available()` first)."""
  if x.dtype != jnp.float32:
    raise TypeError(f"native top_k takes float32, got {x.dtype}")
  if not 1 <= k <= x.shape[-1]:
    raise ValueError(f"native top_k: k={k} must lie in [1, {x.shape[-1]}]")
  shape = x.shape[:-1] + (k,)
  call = jax.ffi.ffi_call(TARGET, (jax.ShapeDtypeStruct(shape, jnp.float32), jax.ShapeDtypeStruct(shape, jnp.int32)),
                          vmap_method="broadcast_all")
  return tuple(call(x, k=np.int64(k)))


def usable_for(x: jax.Array) -> bool:
  """Whether `top_k` serves this array here: float32, traced for the CPU backend, the handler available."""
  return x.dtype == jnp.float32 and jax.default_backend() == "cpu" and available()
