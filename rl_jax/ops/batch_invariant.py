"""Batch-invariant products for the zero-mismatch mode (`ModelConfig.batch_invariant`): each output row depends on its own input row only."""
from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp

# Set by `Transformer` around its forward (and its head) while it is traced: the products deep in
# the MoE dispatch and the quantization-aware `linear` read it instead of a config argument
# threaded through every signature. It is only ever read at trace time.
_ACTIVE = contextvars.ContextVar("rl_jax_batch_invariant", default=False)


@contextlib.contextmanager
def scope(on: bool):
  """Traces the enclosed model code in (or out of) the batch-invariant mode."""
  token = _ACTIVE.set(bool(on))
  try:
    yield
  finally:
    _ACTIVE.reset(token)


def active() -> bool:
  return _ACTIVE.get()


def ordered_sum(term, n: int) -> jax.Array:
  """sum_{i < n} term(i), added in index order by a loop of elementwise steps (each term an array of
  one shape): the accumulation every product of the mode is made of.

  Why not `jnp.dot`: XLA:CPU picks a dot's kernel by its shape, so a row's result depends on how
  many rows share the call (the rows of a [4, 32] @ [32, 4] product differ from the same rows of a
  [64, 32] one by up to 2e-6), and a multiply-and-sum written out is rewritten back into that dot.
  A loop of elementwise steps is computed per element, the same in every program.
  """
  return jax.lax.fori_loop(1, n, lambda i, a: a + term(i), term(0))


def ordered_dot(x_sD: jax.Array, w_DN: jax.Array) -> jax.Array:
  """x @ w over the last axis of x as an `ordered_sum` over D, in x's dtype."""
  w = w_DN.astype(x_sD.dtype)
  return ordered_sum(lambda i: x_sD[..., i, None] * w[i], x_sD.shape[-1])


def ordered_bmm(x_ECD: jax.Array, w_EDF: jax.Array) -> jax.Array:
  """`einsum('ecd,edf->ecf')` (the experts' slab) as an `ordered_sum` over D."""
  w = w_EDF.astype(x_ECD.dtype)
  return ordered_sum(lambda i: x_ECD[..., i, None] * w[:, i, None, :], x_ECD.shape[-1])
