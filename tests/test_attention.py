"""Blocked causal attention equals one masked softmax over all S keys, forward and gradients."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax.models import layers
from rl_jax.ops import attention as attn

B, G, R, D = 3, 2, 2, 8


def _inputs(s: int, seed: int = 0):
  k = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(k[0], (B, s, G, R, D))
  kk = jax.random.normal(k[1], (B, s, G, D))
  v = jax.random.normal(k[2], (B, s, G, D))
  # Row 0 full, row 1 left-padded by 7, row 2 right-padded by 5: the trainer's causal mask.
  valid = np.ones((B, s), bool)
  valid[1, :7] = False
  valid[2, s - 5:] = False
  mask = jnp.tril(jnp.ones((s, s), bool))[None] & jnp.asarray(valid)[:, None, :]
  return q, kk, v, mask


@pytest.mark.parametrize("s,n_blocks", [(160, 4), (100, 3), (40, 1)])
def test_blocked_causal_attention_equals_full(s, n_blocks):
  q, k, v, mask = _inputs(s)
  assert len(attn.query_blocks(s)) == n_blocks and attn.query_blocks(s)[-1][1] == s
  full = lambda q, k, v: attn._attend(q, k, v, mask, "bcgd", "bcgd")  # pylint: disable=protected-access
  blocked = lambda q, k, v: attn._causal_attention(q, k, v, mask)  # pylint: disable=protected-access
  seen_BS = np.asarray(jnp.any(mask, axis=-1))  # queries with at least one visible key
  assert not seen_BS[1, :7].any() and seen_BS[1, 7:].all()  # the left padding sees nothing
  got, want = jax.jit(blocked)(q, k, v), full(q, k, v)
  np.testing.assert_allclose(np.asarray(got)[seen_BS], np.asarray(want)[seen_BS], rtol=0, atol=1e-6)
  # Gradients of a loss over the queries that see a key: the skipped keys get exactly none.
  w = jnp.asarray(seen_BS, jnp.float32)[:, :, None, None, None]
  loss = lambda f: lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)) * w)
  g_got = jax.jit(jax.grad(loss(blocked), argnums=(0, 1, 2)))(q, k, v)
  g_want = jax.grad(loss(full), argnums=(0, 1, 2))(q, k, v)
  for a, b in zip(g_got, g_want):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * max(1.0, float(jnp.max(jnp.abs(b)))))


def test_bf16_prefill_and_decode_with_the_cache():
  """A bf16 model prefills several tokens into the heads-major cache and decodes one (XLA:CPU
  has no bf16 x bf16 -> f32 dot for the transposed-key layout), close to the float32 model."""
  from rl_jax.models import ModelConfig, Transformer, init_cache  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  base = dict(vocab_size=32, d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=64)
  tok = jnp.asarray(np.random.default_rng(0).integers(0, 32, (8, 6)), jnp.int32)
  logits = {}
  for dtype in ("float32", "bfloat16"):
    model = Transformer(ModelConfig(**base, dtype=dtype), rngs=nnx.Rngs(0))
    cache = init_cache(model.cfg, 8, 8, layers.dtype_of(dtype))
    out = model(tok[:, :5], cache=cache, cache_index=0)
    step = model(tok[:, 5:6], cache=out.cache, cache_index=5)
    logits[dtype] = np.asarray(jnp.concatenate([out.logits_BSV, step.logits_BSV], axis=1), np.float32)
  assert np.isfinite(logits["bfloat16"]).all()
  np.testing.assert_allclose(logits["bfloat16"], logits["float32"], atol=0.05)
