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
  # The reference jitted too: eagerly every op compiles its own XLA program.
  got, want = jax.jit(blocked)(q, k, v), jax.jit(full)(q, k, v)
  np.testing.assert_allclose(np.asarray(got)[seen_BS], np.asarray(want)[seen_BS], rtol=0, atol=1e-6)
  # Gradients of a loss over the queries that see a key: the skipped keys get exactly none.
  w = jnp.asarray(seen_BS, jnp.float32)[:, :, None, None, None]
  loss = lambda f: lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)) * w)
  g_got = jax.jit(jax.grad(loss(blocked), argnums=(0, 1, 2)))(q, k, v)
  g_want = jax.jit(jax.grad(loss(full), argnums=(0, 1, 2)))(q, k, v)
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


@pytest.mark.parametrize("impl,invariant", [("xla", False), ("blocked", False), ("blocked", True)])
def test_per_row_q_offset_equals_each_row_alone(impl, invariant):
  """q_offset `[B]` (the continuous engine's refill prefill, one row per device): row b is the
  call with its own scalar offset alone; bit for bit in the batch-invariant mode, whose loop runs
  to the furthest row's key block and must leave a row past its own untouched, even a query that
  sees no key (left padding: its value then depends on the blocks it visited)."""
  s, c = 4, 150  # 3 key blocks of the invariant mode's 64
  ks = jax.random.split(jax.random.key(3), 3)
  q = jax.random.normal(ks[0], (B, s, G, R, D))
  kT = jax.random.normal(ks[1], (B, G, D, c))
  v = jax.random.normal(ks[2], (B, G, c, D))
  offsets = np.array([0, 70, 140], np.int32)
  valid = np.ones((B, c), bool)
  valid[0, :10] = False  # row 0's queries (slots 0-3) see no key
  run = lambda q, kT, v, valid, off: attn.attention(q, kT, v, jnp.asarray(valid), q_offset=off, kv_layout="cache",
                                                    impl=impl, invariant=invariant)
  got = np.asarray(jax.jit(run)(q, kT, v, valid, jnp.asarray(offsets)))
  for b in range(B):
    one = np.asarray(jax.jit(run)(q[b:b + 1], kT[b:b + 1], v[b:b + 1], valid[b:b + 1], jnp.int32(offsets[b])))
    if invariant:
      np.testing.assert_array_equal(got[b:b + 1], one, err_msg=f"row {b}")
    else:  # another batch size may block a dot's reduction differently: rounding only
      seen = slice(None) if b else slice(0, 0)
      np.testing.assert_allclose(got[b:b + 1][:, seen], one[:, seen], rtol=0, atol=1e-6, err_msg=f"row {b}")
