"""XLA compiler options of the sampler's programs: on CPU, decode without YNNPACK's library fusions."""
from __future__ import annotations

import os

import jax

# XLA:CPU hands dots (and some element-wise / reduce ops) to YNNPACK "library fusions". At decode
# shapes that loses: a step multiplies a few rows by every weight matrix, and YNNPACK packs the
# weight operand at every call, so the MoE layers' batched expert dots (`[E, C, D] x [E, D, F]`,
# C ~ 16) ran at 30-45 GFLOP/s, 1.38x slower than through XLA's own dot emitter. Without the
# fusions MoE decode ran 1.23-1.33x faster on the peer benchmark's model, dense decode 1.05-1.08x
# (`benchmarks/bench_sampler_xla.py`, docs/performance.md). The trainer's programs (large row counts,
# where the packing amortizes) keep XLA's default: the same A/B on its update and old-policy forward
# moved nothing outside noise.
CPU_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}

# Set to 1 to compile the sampler with XLA's default (library fusions on), e.g. to A/B it.
ENV_KEEP_DEFAULT = "RL_JAX_SAMPLER_XLA_DEFAULT"


def compiler_options(backend: str | None = None) -> dict | None:
  """The sampler programs' `compiler_options`: `CPU_OPTIONS` on the CPU backend (default
  `jax.default_backend()`), None elsewhere (the options are XLA:CPU's; other backends' compilers
  need not know them) or when `RL_JAX_SAMPLER_XLA_DEFAULT=1`."""
  if os.environ.get(ENV_KEEP_DEFAULT, "0") == "1":
    return None
  return dict(CPU_OPTIONS) if (backend or jax.default_backend()) == "cpu" else None


class SamplerJit:
  """`jax.jit(fn, **kw)` with `compiler_options()`, built at first use: the options depend on the
  backend, which must not be initialized at import time (before `jax.distributed.initialize`).

  A call from inside another trace (a tracer among the arguments: an enclosing jit, vmap or
  eval_shape) goes to a plain `jax.jit(fn, **kw)`, since jax takes compiler options only at the
  top level: it is inlined there and compiled with the enclosing program's options. Calls,
  `.lower` and any other attribute go to the jit; one jit of each kind per object, so jit's cache
  works as before.
  """

  def __init__(self, fn, **jit_kwargs):
    self._fn, self._kwargs, self._jit = fn, jit_kwargs, None
    self._nested = jax.jit(fn, **jit_kwargs)
    self.__wrapped__ = fn
    self.__doc__ = fn.__doc__

  def jitted(self):
    """The top-level jit (compiler options chosen now, on first use)."""
    if self._jit is None:
      self._jit = jax.jit(self._fn, compiler_options=compiler_options(), **self._kwargs)
    return self._jit

  def __call__(self, *args, **kwargs):
    traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((args, kwargs)))
    return (self._nested if traced else self.jitted())(*args, **kwargs)

  def lower(self, *args, **kwargs):
    return self.jitted().lower(*args, **kwargs)

  def __getattr__(self, name):  # trace, eval_shape, clear_cache, ...
    return getattr(self.jitted(), name)


def sampler_jit(fn, **jit_kwargs) -> SamplerJit:
  """A sampler program's jit: `jax.jit(fn, **jit_kwargs)` compiled with `compiler_options()`."""
  return SamplerJit(fn, **jit_kwargs)
