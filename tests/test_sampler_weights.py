"""Sampler weights: fixed weight noise (relative / absolute) and the jitted, non-recompiling sync."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rl_jax.config_utils import ConfigError
from rl_jax.models.config import ModelConfig
from rl_jax.models.quantize import quantize_params
from rl_jax.models.transformer import Transformer
from rl_jax.quant.config import QuantConfig
from rl_jax.quant.qtensor import QTensor
from rl_jax.sampler import weights as W

CFG = ModelConfig(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64, n_experts=4,
                  moe_d_ff=32, mlp_only_layers=(0,), tie_embeddings=False)


@pytest.fixture(scope="module")
def params():
  return nnx.split(Transformer(CFG, rngs=nnx.Rngs(0)))


def test_make_noise_modes(params):
  _, state = params
  assert W.make_noise(state, "none", 0.1, jax.random.key(0)) is None
  with pytest.raises(ConfigError, match="sampler.noise"):
    W.make_noise(state, "gaussian", 0.1, jax.random.key(0))
  sigma = 0.05
  rel = W.make_noise(state, "relative", sigma, jax.random.key(0))
  ab = W.make_noise(state, "absolute", sigma, jax.random.key(0))
  again = W.make_noise(state, "relative", sigma, jax.random.key(0))
  # numpy from here on: eager jnp ops would compile once per leaf shape.
  leaves = lambda tree: [np.asarray(x) for x in jax.tree.leaves(tree)]
  w_leaves, rel_l, ab_l = leaves(state), leaves(rel), leaves(ab)
  assert jax.tree.structure(rel) == jax.tree.structure(state)
  for w, d_rel, d_abs, d_again in zip(w_leaves, rel_l, ab_l, leaves(again)):
    assert d_rel.shape == w.shape and d_rel.dtype == np.float32
    np.testing.assert_array_equal(d_rel, d_again)  # drawn once: a function of the key
    # Every floating leaf is perturbed, norm scales included (isotropic over theta).
    assert np.all(d_abs != 0)
  # relative: Delta / w0 ~ N(0, sigma^2); absolute: Delta ~ N(0, sigma^2) (pooled over leaves).
  ratio = np.concatenate([np.ravel(d / w) for d, w in zip(rel_l, w_leaves)])
  pooled = np.concatenate([np.ravel(d) for d in ab_l])
  assert ratio.size > 10_000
  np.testing.assert_allclose(ratio.std(), sigma, rtol=0.05)
  np.testing.assert_allclose(pooled.std(), sigma, rtol=0.05)
  assert abs(pooled.mean()) < 3 * sigma / np.sqrt(pooled.size)


def test_sync_weights_order_and_no_recompile(params):
  graphdef, state = params
  delta = W.make_noise(state, "relative", 0.02, jax.random.key(1))
  none = QuantConfig.preset("none")
  # Programs compiled by sync_weights' own jit (its cache), so "no recompilation" is read
  # from jax rather than from a counter kept in the library.
  compiled = W._sync._cache_size  # pylint: disable=protected-access
  base = compiled()
  s0 = W.sync_weights(state, None, none, "float32")
  jax.tree.map(np.testing.assert_array_equal, s0, state)  # fp32, no noise, no quant: identity
  s1 = W.sync_weights(state, delta, none, "float32")
  jax.tree.map(lambda a, w, d: np.testing.assert_allclose(a, w + d, rtol=0, atol=1e-7), s1, state, delta)
  # A trainer step later: new values, same shapes -> same program.
  moved = jax.tree.map(lambda w: w * 1.01, state)
  s2 = W.sync_weights(moved, delta, none, "float32")
  jax.tree.map(lambda a, w, d: np.testing.assert_allclose(a, w + d, rtol=0, atol=1e-7), s2, moved, delta)
  assert compiled() == base + 2  # one program with noise, one without

  # Order: noise, then quantization, then cast.
  q = QuantConfig.preset("int8_wa_int8_kv")
  sq = W.sync_weights(state, delta, q, "bfloat16")
  expect = jax.jit(quantize_params, static_argnums=1)(jax.tree.map(lambda w, d: w + d, state, delta), q)
  is_q = lambda x: isinstance(x, QTensor)
  flat_sq = jax.tree.leaves(sq, is_leaf=is_q)
  flat_ex = jax.tree.leaves(expect, is_leaf=is_q)
  assert sum(map(is_q, flat_sq)) == 2 * 4 + 3 + 3  # q/k/v/o x2 layers, dense MLP, MoE experts
  for a, e in zip(flat_sq, flat_ex):
    if is_q(a):
      np.testing.assert_array_equal(a.values, e.values)
    else:  # embeddings, router, norms: plain, cast to the sampler dtype
      assert a.dtype == jnp.bfloat16
      np.testing.assert_array_equal(a, e.astype(jnp.bfloat16))
  W.sync_weights(moved, delta, q, "bfloat16")
  assert compiled() == base + 3
  # The sampler graph computes in bf16 and merges with the synced weights (a bf16
  # sampler generating is exercised by test_sampler_quant's slow preset sweep).
  model = nnx.merge(W.sampler_graphdef(CFG, "bfloat16"), sq)
  assert model.cfg.dtype == "bfloat16" and model.cfg.param_dtype == "bfloat16"
