"""Sampler building blocks: threshold top-k == lax.top_k bit for bit, first_argmax, two-stage categorical."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax.sampler import generate as gen


def _cases(b, v):
  x = jax.nn.log_softmax(3 * jax.random.normal(jax.random.key(v), (b, v)))
  return {"plain": x, "ties": jnp.round(2 * x), "few values": jnp.round(x / 4),
          "-inf ties": jnp.where(x > -8, -jnp.inf, x), "signed zeros": jnp.where(x > -9, -0.0, 0.0 * x),
          "all equal": jnp.zeros_like(x), "positive": -x}


@pytest.mark.parametrize("b,v,k", [(4, 4096, 128), (3, 1000, 16), (2, 2053, 64)])
def test_threshold_top_k_equals_lax_top_k(b, v, k):
  """Values, ids and tie order equal lax.top_k's; massive ties take the fallback (fits False)."""
  fn = jax.jit(lambda x: (gen.threshold_top_k(x, k), gen.exact_top_k(x, k)))
  fits = {}
  for name, arr in _cases(b, v).items():
    want = jax.lax.top_k(arr, k)
    (vals, ids, fit), got = fn(arr)
    fits[name] = bool(fit)
    for g in ((vals, ids), got) if fit else (got,):
      np.testing.assert_array_equal(g[1], want[1], err_msg=name)
      np.testing.assert_array_equal(np.asarray(g[0]).view(np.uint32), np.asarray(want[0]).view(np.uint32),
                                    err_msg=name)  # bit for bit, -0.0 included
  assert fits["plain"] and fits["ties"] and not fits["all equal"], fits


def test_first_argmax_equals_argmax():
  x = jax.random.normal(jax.random.key(0), (8, 300))
  for arr in (x, jnp.round(x), jnp.zeros_like(x), jnp.where(x > 0, jnp.inf, x)):
    np.testing.assert_array_equal(jax.jit(gen.first_argmax)(arr), jnp.argmax(arr, axis=-1))


@pytest.mark.parametrize("v", [12, 100])
def test_categorical_has_the_softmax_distribution(v):
  """Two-stage draws follow softmax(logits) (chi-square), never hit a -inf logit, and are keyed."""
  logits = jax.random.normal(jax.random.key(1), (v,)) * 1.5
  logits = logits.at[3].set(-jnp.inf).at[v - 1].set(-jnp.inf)  # in the padded last chunk too
  n = 40_000
  draws = np.asarray(jax.jit(jax.vmap(gen.categorical, (0, None)))(jax.random.split(jax.random.key(2), n), logits))
  counts = np.bincount(draws, minlength=v)
  assert counts[3] == 0 and counts[v - 1] == 0
  p = np.asarray(jax.nn.softmax(logits))
  live = p > 0
  chi2 = np.sum((counts[live] - n * p[live]) ** 2 / (n * p[live]))
  dof = live.sum() - 1
  assert chi2 < dof + 5 * np.sqrt(2 * dof), (chi2, dof)  # ~5 sigma of the chi-square law
  k = jax.random.key(7)
  assert int(gen.categorical(k, logits)) == int(gen.categorical(k, logits))
