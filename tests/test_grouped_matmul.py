"""grouped_matmul: the Pallas kernels (interpret mode) vs lax.ragged_dot and float64, forward and VJP, and no dense expansion."""
import jax
import jax.extend  # the jaxpr walk reads jax.extend.core: imported here, not by whichever module loaded it first
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax.ops import grouped_matmul as G

# 16-row / 16-column tiles, so small shapes exercise every path: M=45 (not a multiple of
# 16), D=40 (3 reduction steps, the last one zero-padded), F=20 (2 column tiles).
TILES = G.Tiles(tm=16, tk=16, tn=16, td=16, tf=16)
M, D, F, E = 45, 40, 20, 6
GROUP_SIZES = [
    [0, 20, 3, 0, 18, 0],   # zeros first / inside / last, a group > a tile, tiles spanning 2-3
    [45, 0, 0, 0, 0, 0],    # one group over every tile
    [5, 5, 5, 5, 5, 5],     # six groups inside tiles; rows 30-44 belong to no group (-> 0)
    [0, 0, 0, 0, 0, 0],     # nothing assigned: all outputs and gradients 0
    [1, 16, 15, 1, 0, 12],  # boundaries one row off the tile edges
]


def _exact(x, w, dy, sizes):
  """float64 y = x_e @ w_e, dx = dy_e @ w_e^T, dw_e = x_e^T dy_e, and the |.| products."""
  y, dx, dw = np.zeros((M, F)), np.zeros((M, D)), np.zeros((E, D, F))
  ay, adx, adw = np.zeros_like(y), np.zeros_like(dx), np.zeros_like(dw)
  s = 0
  for e, n in enumerate(sizes):
    r = slice(s, s + n)
    y[r], ay[r] = x[r] @ w[e], np.abs(x[r]) @ np.abs(w[e])
    dx[r], adx[r] = dy[r] @ w[e].T, np.abs(dy[r]) @ np.abs(w[e]).T
    dw[e], adw[e] = x[r].T @ dy[r], np.abs(x[r]).T @ np.abs(dy[r])
    s += n
  return (y, dx, dw), (ay, adx, adw), (D, F, M)


@pytest.fixture(scope="module")
def vjps():
  """Jitted (y, dx, dw) of both impls; group sizes are traced, so one compile per dtype."""
  def run(impl):
    @jax.jit
    def f(x, w, gs, dy):
      y, vjp = jax.vjp(lambda x, w: G.grouped_matmul(x, w, gs, impl=impl, tiles=TILES), x, w)
      return (y, *vjp(dy))
    return f
  return {impl: run(impl) for impl in ("pallas", "ragged_dot")}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pallas_equals_ragged_dot_forward_and_grads(vjps, dtype):
  """y, dx, dw of the kernels and of lax.ragged_dot are both within rounding of float64."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((M, D)), dtype)
  w = jnp.asarray(rng.standard_normal((E, D, F)), dtype)
  dy = jnp.asarray(rng.standard_normal((M, F)), dtype)
  xd, wd, dyd = (np.asarray(a, np.float64) for a in (x, w, dy))  # the rounded inputs, exactly
  # float32 accumulation of K terms, then one rounding to the output dtype.
  u_out = 2.0**-8 if dtype == jnp.bfloat16 else 0.0
  for sizes in GROUP_SIZES:
    gs = jnp.asarray(sizes, jnp.int32)
    exact, absprod, ks = _exact(xd, wd, dyd, sizes)
    outs = {impl: f(x, w, gs, dy) for impl, f in vjps.items()}
    for name, ex, ab, k, got, ref in zip(("y", "dx", "dw"), exact, absprod, ks,
                                         outs["pallas"], outs["ragged_dot"]):
      assert got.dtype == dtype and got.shape == ex.shape, (name, got.dtype, got.shape)
      bound = u_out * np.abs(ex) + 2 * (1 + u_out) * k * 2.0**-24 * ab
      got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
      for label, out in (("pallas", got), ("ragged_dot", ref)):
        excess = np.abs(out - ex) - bound
        assert np.all(excess <= 0), (sizes, name, label, float(np.max(excess)))
      # Where the exact result is 0 (unassigned rows, empty groups) both give exactly 0.
      np.testing.assert_array_equal(got[ab == 0], 0.0)
      assert np.all(np.abs(got - ref) <= 2 * bound), (sizes, name)


def test_default_tiles_and_promoted_dtype():
  """Default (larger) tiles on a matrix smaller than one tile; bf16 x with f32 w -> f32."""
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((10, 24)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((3, 24, 8)), jnp.float32)
  gs = jnp.asarray([4, 0, 6], jnp.int32)
  y = G.grouped_matmul(x, w, gs, impl="pallas")
  ref = G.grouped_matmul(x, w, gs, impl="ragged_dot")
  assert y.dtype == ref.dtype == jnp.float32
  xd, wd = np.asarray(x, np.float64), np.asarray(w, np.float64)
  ex = np.concatenate([xd[:4] @ wd[0], xd[4:] @ wd[2]])
  bound = 2 * 24 * 2.0**-24 * np.concatenate([np.abs(xd[:4]) @ np.abs(wd[0]),
                                              np.abs(xd[4:]) @ np.abs(wd[2])])
  assert np.all(np.abs(np.asarray(y, np.float64) - ex) <= bound)


def _shapes(jaxpr):
  """Every variable shape in a jaxpr and all the jaxprs nested in its equations."""
  for v in list(jaxpr.invars) + list(jaxpr.outvars) + list(jaxpr.constvars):
    if hasattr(v, "aval"):
      yield getattr(v.aval, "shape", ())
  for eqn in jaxpr.eqns:
    for v in eqn.outvars:
      yield getattr(v.aval, "shape", ())
    for p in eqn.params.values():
      for cand in (p if isinstance(p, (tuple, list)) else (p,)):
        inner = getattr(cand, "jaxpr", cand)
        if isinstance(inner, jax.extend.core.Jaxpr):
          yield from _shapes(inner)


def test_grad_never_materializes_rows_by_experts():
  """jax.grad through `pallas` has no [M, E*F] / [M, E, F] value and small compiled temps.

  XLA:CPU lowers ragged_dot densely: its grad needs >= M*E*F*4 bytes of temporaries, the
  control that shows the byte bound discriminates.
  """
  m, d, f, e = 256, 16, 64, 32
  gs = jnp.full((e,), m // e, jnp.int32)
  x, w = jnp.zeros((m, d), jnp.float32), jnp.zeros((e, d, f), jnp.float32)
  dense_bytes = m * e * f * 4

  def grad_fn(impl):
    loss = lambda x, w: jnp.sum(G.grouped_matmul(x, w, gs, impl=impl, tiles=TILES) ** 2)
    return jax.grad(loss, argnums=(0, 1))

  shapes = set(_shapes(jax.make_jaxpr(grad_fn("pallas"))(x, w).jaxpr))
  assert (m, d) in shapes and (e, d, f) in shapes  # the walk does see the operands
  for bad in [(m, e * f), (m, e, f), (e, m, f), (m, e * d), (m, e, d)]:
    assert bad not in shapes, bad
  temps = {impl: jax.jit(grad_fn(impl)).lower(x, w).compile().memory_analysis().temp_size_in_bytes
           for impl in ("pallas", "ragged_dot")}
  assert temps["pallas"] < dense_bytes // 4, temps
  assert temps["ragged_dot"] >= dense_bytes, temps


def test_impl_resolution_and_errors():
  expected = "pallas" if jax.default_backend() == "gpu" else "ragged_dot"
  assert G.resolve_impl("auto") == expected
  assert G.resolve_impl("pallas") == "pallas"
  with pytest.raises(ValueError, match="impl"):
    G.resolve_impl("slab")
  with pytest.raises(ValueError, match="powers of two"):
    G.grouped_matmul(jnp.ones((4, 4)), jnp.ones((1, 4, 4)), jnp.asarray([4]), impl="pallas",
                     tiles=G.Tiles(tm=24))


def test_pallas_lowers_to_triton_for_cuda():
  """Lowered for a CUDA GPU (abstractly; none needed): forward, dx and dw are Triton kernels.

  The Triton CompilerParams pin the Triton backend; without them jax 0.10 picks Mosaic GPU.
  """
  m, d, f, e = 1000, 256, 384, 8  # ragged M: padded to whole row tiles
  sds = jax.ShapeDtypeStruct

  def fwd_bwd(x, w, gs, dy):
    y, vjp = jax.vjp(lambda x, w: G.grouped_matmul(x, w, gs, impl="pallas", interpret=False), x, w)
    return (y, *vjp(dy))

  text = jax.jit(fwd_bwd).trace(
      sds((m, d), jnp.bfloat16), sds((e, d, f), jnp.bfloat16), sds((e,), jnp.int32),
      sds((m, f), jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("xla.gpu.triton") == 3, text.count("xla.gpu.triton")
  assert "mosaic_gpu" not in text
