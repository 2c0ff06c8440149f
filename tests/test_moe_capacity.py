"""MoE experts: the capacity-slab path equals the ragged_dot reference, forward and gradients, dropless."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rl_jax.models import moe as moe_lib
from rl_jax.models.config import ModelConfig
import tolerances as tol

E, K, D, F = 8, 2, 16, 12


def _weights(seed=0):
  k = jax.random.split(jax.random.key(seed), 3)
  return (0.3 * jax.random.normal(k[0], (E, D, F)), 0.3 * jax.random.normal(k[1], (E, D, F)),
          0.3 * jax.random.normal(k[2], (E, F, D)))


def _routing(n, kind, seed=0):
  """ids [n, K] (distinct per token) and gates: random, or as skewed as top-2 allows."""
  rng = np.random.default_rng(seed)
  if kind == "random":
    ids = np.stack([rng.permutation(E)[:K] for _ in range(n)])
  else:  # every token on experts 3 and 5: one expert holds M / 2 > C assignments
    ids = np.tile([3, 5], (n, 1))
  gates = rng.uniform(0.1, 1.0, (n, K))
  return jnp.asarray(ids, jnp.int32), jnp.asarray(gates / gates.sum(-1, keepdims=True), jnp.float32)


def _head(n):
  return jnp.arange(n * D).reshape(n, D) / (n * D)


def _loss(fn):
  def f(x, gates, wg, wu, wd, ids):
    y = fn(x, ids, gates, wg, wu, wd, E)
    return jnp.sum(jnp.sin(y) * _head(y.shape[0]).astype(y.dtype))
  return f


GRADS = ("x", "gates", "w_gate", "w_up", "w_down")


def _check_all(y_got, y_want, g_got, g_want, x, ids, gates, ws):
  """Same products in another summation order: the two programs differ by float32 (float64)
  rounding alone, bounded from the magnitudes of every sum's terms (tests/tolerances.py)."""
  u = tol.F64_U if np.asarray(y_want).dtype == np.float64 else tol.F32_U
  bounds = tol.swiglu_experts_bounds(x, ids, gates, *ws, _head(x.shape[0]), head="sin")
  tol.assert_rounding_close(y_got, y_want, bounds["y"], "y", u=u)
  for name, a, b in zip(GRADS, g_got, g_want):
    tol.assert_rounding_close(a, b, bounds[name], f"d loss / d {name}", u=u)


_SLOW = pytest.mark.slow


@pytest.mark.parametrize("n,kind,x64", [
    (32, "random", False), (32, "skewed", False), (3, "random", False),
    # float64: the two paths agree to 1e-12, so the float32 slack is rounding, not a bug.
    pytest.param(32, "random", True, marks=_SLOW), pytest.param(32, "skewed", True, marks=_SLOW),
    pytest.param(200, "random", False, marks=_SLOW)])
def test_forward_and_grads_equal_ragged(n, kind, x64):
  with jax.enable_x64(x64):
    _check(n, kind, jnp.float64 if x64 else jnp.float32)


def _check(n, kind, dtype):
  x = jax.random.normal(jax.random.key(1), (n, D), dtype)
  ids, gates = _routing(n, kind)
  gates = gates.astype(dtype)
  ws = tuple(w.astype(dtype) for w in _weights())
  m = n * K
  c = moe_lib.capacity_slots(m, E)
  loads = np.bincount(np.asarray(ids).ravel(), minlength=E)
  # The case exercises the branch it means to: capacity for random routing, fallback when skewed.
  assert (loads.max() <= c) == (kind == "random"), (loads, c)
  # The references jitted too: eagerly every op compiles its own XLA program.
  want = jax.jit(moe_lib.ragged_experts, static_argnums=6)(x, ids, gates, *ws, E)
  got = jax.jit(moe_lib.dropless_experts, static_argnums=6)(x, ids, gates, *ws, E)
  g_want = jax.jit(jax.grad(_loss(moe_lib.ragged_experts), argnums=(0, 1, 2, 3, 4)))(x, gates, *ws, ids)
  g_got = jax.jit(jax.grad(_loss(moe_lib.dropless_experts), argnums=(0, 1, 2, 3, 4)))(x, gates, *ws, ids)
  _check_all(got, want, g_got, g_want, x, ids, gates, ws)
  if c < m and kind == "random":  # the slab alone (no switch) on routing that fits, too
    slab = jax.jit(moe_lib._capacity_experts, static_argnums=(6, 7))(  # pylint: disable=protected-access
        x, ids, gates, *ws, E, c)
    bounds = tol.swiglu_experts_bounds(x, ids, gates, *ws, _head(n), head="sin")
    tol.assert_rounding_close(slab, want, bounds["y"], "slab y",
                              u=tol.F64_U if dtype == jnp.float64 else tol.F32_U)


def test_capacity_slots():
  assert moe_lib.capacity_slots(64, 8) == 16  # 2 x the mean load of 8
  assert moe_lib.capacity_slots(6, 8) == 6  # never more than M: then no fallback is needed
  assert moe_lib.capacity_slots(1000, 8) == 256
  assert moe_lib.capacity_slots(1000, 8, 1.25) == 160  # ceil(125 x 1.25) = 157, up to a multiple of 8
  assert moe_lib.capacity_tiers(400, 8) == (64, 104)  # 1.25 and 2 x the mean load of 50
  assert moe_lib.capacity_tiers(64, 8) == (16,)  # both tiers round to 16 slots
  assert moe_lib.capacity_tiers(6, 8) == (6,)  # one tier covers all M: no fallback


def _tier_routing(kind: str, n: int = 200):
  """ids [n, K] whose busiest expert lands in tier 0 (every load 50), tier 1 (80) or past both (200)."""
  i = np.arange(n)
  if kind == "balanced":
    ids = np.stack([i % E, (i + 1) % E], axis=1)
  elif kind == "mid":  # expert 0 on 80 tokens, the others share the rest
    rest = np.stack([1 + i % (E - 1), 1 + (i + 1) % (E - 1)], axis=1)
    ids = np.where((i < 80)[:, None], np.stack([np.zeros(n, int), 1 + i % (E - 1)], axis=1), rest)
  else:
    ids = np.tile([3, 5], (n, 1))
  gates = np.random.default_rng(0).uniform(0.1, 1.0, (n, K))
  return jnp.asarray(ids, jnp.int32), jnp.asarray(gates / gates.sum(-1, keepdims=True), jnp.float32)


@pytest.mark.parametrize("kind,branch", [("balanced", 0), ("mid", 1), ("skewed", 2)])
def test_each_capacity_tier_equals_ragged(kind, branch):
  """Whichever branch the busiest expert picks (1.25x slab, 2x slab, ragged fallback), forward and
  gradients equal the ragged reference."""
  n = 200
  ids, gates = _tier_routing(kind, n)
  tiers = moe_lib.capacity_tiers(n * K, E)
  loads = np.bincount(np.asarray(ids).ravel(), minlength=E)
  assert int(np.sum(loads.max() > np.asarray(tiers))) == branch, (loads, tiers)  # the case hits its branch
  x = jax.random.normal(jax.random.key(1), (n, D))
  ws = _weights()
  got = jax.jit(moe_lib.dropless_experts, static_argnums=6)(x, ids, gates, *ws, E)
  # The references jitted too: eagerly every op compiles its own XLA program.
  want = jax.jit(moe_lib.ragged_experts, static_argnums=6)(x, ids, gates, *ws, E)
  g_want = jax.jit(jax.grad(_loss(moe_lib.ragged_experts), argnums=(0, 1, 2, 3, 4)))(x, gates, *ws, ids)
  g_got = jax.jit(jax.grad(_loss(moe_lib.dropless_experts), argnums=(0, 1, 2, 3, 4)))(x, gates, *ws, ids)
  _check_all(got, want, g_got, g_want, x, ids, gates, ws)


@pytest.mark.parametrize("replay", [pytest.param(False, marks=_SLOW), True])
def test_moe_layer_with_replay_equals_ragged(replay, monkeypatch):
  """The whole MoE layer (router, replay, aux loss) and its gradients match the ragged reference;
  replay forces every masked token onto experts 0 and 1 (the fallback branch)."""
  cfg = ModelConfig(vocab_size=32, d_model=D, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8, d_ff=32,
                    n_experts=E, n_experts_per_tok=K, moe_d_ff=F, init_std=0.3)
  layer = moe_lib.MoE(cfg, rngs=nnx.Rngs(0))
  b, s = 2, 12
  x = jax.random.normal(jax.random.key(2), (b, s, D))
  valid = jnp.ones((b, s), bool)
  r_ids = jnp.tile(jnp.asarray([0, 1], jnp.int32), (b, s, 1)) if replay else None
  r_mask = (jnp.arange(s) < 9)[None].repeat(b, 0) if replay else None
  graphdef, state = nnx.split(layer)

  def run(state, x):
    y, ids, logits, aux, overflow = nnx.merge(graphdef, state)(x, valid, r_ids, r_mask)
    return jnp.sum(jnp.cos(y)) + aux, (y, ids, overflow)

  # Jitted (eagerly every op compiles its own XLA program); a fresh jit per side, traced after the patch.
  vg = lambda: jax.jit(jax.value_and_grad(run, argnums=(0, 1), has_aux=True))
  (l_got, (y_got, ids_got, over)), g_got = vg()(state, x)
  monkeypatch.setattr(moe_lib, "dropless_experts", moe_lib.ragged_experts)
  (l_want, (y_want, ids_want, _)), g_want = vg()(state, x)
  np.testing.assert_array_equal(ids_got, ids_want)
  assert float(over) == 0.0  # the single-device dispatch never falls back to another one
  # The router, softmax and aux loss are the same program on both sides (no reordering); only the
  # experts differ, whose outputs are sums of D, F and K terms: array-scale bounds (an
  # assumption: no cancellation past each array's largest entry), with the loss's own sum over
  # its b s d cosines and the gradients' sums over all b s K assignments of an expert.
  n_rows = b * s * K
  tol_y = tol.array_scale_atol(y_want, D + F + K)
  np.testing.assert_allclose(y_got, y_want, rtol=0, atol=tol_y)
  terms = np.cos(np.asarray(y_want, np.float64))
  np.testing.assert_allclose(l_got, l_want, rtol=0, atol=tol.sum_atol(terms) + terms.size * tol_y)
  for a, w in zip(jax.tree.leaves(g_got), jax.tree.leaves(g_want)):
    np.testing.assert_allclose(a, w, rtol=0, atol=tol.array_scale_atol(w, n_rows * (D + F + K)))
