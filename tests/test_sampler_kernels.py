"""Sampler building blocks: first_argmax == argmax, the two-stage categorical draws softmax(logits)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax.sampler import decode


def test_first_argmax_equals_argmax():
  x = jax.random.normal(jax.random.key(0), (8, 300))
  for arr in (x, jnp.round(x), jnp.zeros_like(x), jnp.where(x > 0, jnp.inf, x)):
    np.testing.assert_array_equal(jax.jit(decode.first_argmax)(arr), jnp.argmax(arr, axis=-1))


@pytest.mark.parametrize("v", [12, 100])
def test_categorical_has_the_softmax_distribution(v):
  """Two-stage draws follow softmax(logits) (chi-square), never hit a -inf logit, and are keyed."""
  logits = jax.random.normal(jax.random.key(1), (v,)) * 1.5
  logits = logits.at[3].set(-jnp.inf).at[v - 1].set(-jnp.inf)  # in the padded last chunk too
  n = 40_000
  draws = np.asarray(jax.jit(jax.vmap(decode.categorical, (0, None)))(jax.random.split(jax.random.key(2), n), logits))
  counts = np.bincount(draws, minlength=v)
  assert counts[3] == 0 and counts[v - 1] == 0
  p = np.asarray(jax.nn.softmax(logits))
  live = p > 0
  chi2 = np.sum((counts[live] - n * p[live]) ** 2 / (n * p[live]))
  dof = live.sum() - 1
  assert chi2 < dof + 5 * np.sqrt(2 * dof), (chi2, dof)  # ~5 sigma of the chi-square law
  k = jax.random.key(7)
  assert int(decode.categorical(k, logits)) == int(decode.categorical(k, logits))
