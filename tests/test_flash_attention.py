"""rl_jax.ops.attention: xla is today's attention bit for bit; blocked (ex-"flash"), native, cudnn's wiring and splash equal it."""
# The tests reach the implementations behind `attention` (cudnn's wiring, splash, the loop bounds).
# pylint: disable=protected-access
import functools
import warnings

import jax
import jax.extend  # _count_eqns reads jax.extend.core: imported here, not by whichever module happened to load it first
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax.ops import attention as attn

# Tiny programs: XLA's backend optimizations cost more than they save (conftest.fast_compile);
# the memory test turns them back on for its own compile.
pytestmark = pytest.mark.usefixtures("fast_compile")

G, D = 2, 8


def _valid(b: int, c: int, kind: str) -> np.ndarray:
  """The key masks the project builds: full, left-padded, right-padded, or ragged (every row
  its own left and right padding, one row with holes, one that sees nothing at the start)."""
  valid = np.ones((b, c), bool)
  if kind == "left":
    valid[1, :7] = False
    valid[2, :c - 3] = False
  elif kind == "right":
    valid[1, c - 5:] = False
    valid[2, 4:] = False
  elif kind == "ragged":
    valid[0, :3] = False
    valid[1, c - 6:] = False
    valid[2, :5] = False
    valid[2, c - 2:] = False
    valid[3, 2:4] = False  # holes: a per-row mask no padding layout builds
    valid[3, 9:10] = False
  return valid


def _inputs(b, s, c, r, kind, kv_layout="bcgd", dtype=jnp.float32, seed=0):
  ks = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(ks[0], (b, s, G, r, D), dtype)
  k = jax.random.normal(ks[1], (b, c, G, D), dtype)
  v = jax.random.normal(ks[2], (b, c, G, D), dtype)
  if kv_layout == "cache":  # kv_cache.LayerKV's heads-major layout
    k, v = jnp.transpose(k, (0, 2, 3, 1)), jnp.swapaxes(v, 1, 2)
  return q, k, v, jnp.asarray(_valid(b, c, kind))


def _seen(valid_BC, s, q_offset, causal):
  """[B, S]: the queries that see at least one key."""
  c = valid_BC.shape[1]
  mask_BSC = np.broadcast_to(np.asarray(valid_BC)[:, None, :], (valid_BC.shape[0], s, c))
  if causal:
    mask_BSC = mask_BSC & (np.arange(c)[None, None, :] <= q_offset + np.arange(s)[None, :, None])
  return mask_BSC.any(-1)


def _check(f_got, f_want, q, k, v, seen_BS, atol_out=2e-6, atol_grad=1e-5):
  """Outputs on the queries that see a key and every gradient of a loss over those queries agree;
  every output and gradient (fully masked queries included) is finite."""
  w = jnp.asarray(seen_BS, jnp.float32)[:, :, None, None, None]

  def run(f):  # one compiled program per implementation: gradients, and the output as aux
    def loss(q, k, v):
      out = f(q, k, v)
      return jnp.sum(jnp.sin(out.astype(jnp.float32)) * w), out
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)

  (g_got, got), (g_want, want) = run(f_got), run(f_want)
  assert got.dtype == want.dtype and got.shape == want.shape
  assert np.isfinite(np.asarray(got, np.float32)).all()
  np.testing.assert_allclose(np.asarray(got, np.float32)[seen_BS], np.asarray(want, np.float32)[seen_BS],
                             rtol=0, atol=atol_out)
  for a, b in zip(g_got, g_want):
    assert a.dtype == b.dtype and np.isfinite(np.asarray(a, np.float32)).all()
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    np.testing.assert_allclose(a, b, rtol=0, atol=atol_grad * max(1.0, float(np.abs(b).max())))


# (rows B, queries S, keys C, q_offset, R, mask kind, causal, kv layout, flash blocks q x k)
CASES = {
    "causal": (2, 40, 40, 0, 2, "full", True, "bcgd", (16, 16)),
    "left_padded": (3, 37, 37, 0, 2, "left", True, "bcgd", (16, 8)),
    "right_padded": (3, 37, 37, 0, 2, "right", True, "bcgd", (8, 16)),
    "ragged_rows_mha": (4, 37, 37, 0, 1, "ragged", True, "bcgd", (16, 16)),
    "ragged_rows_gqa4": (4, 37, 37, 0, 4, "ragged", True, "bcgd", (16, 16)),
    "smaller_than_a_block": (3, 5, 5, 0, 2, "left", True, "bcgd", (16, 16)),
    "one_key_block": (3, 37, 37, 0, 2, "left", True, "bcgd", (8, 64)),
    "chunk_of_a_longer_range": (4, 24, 61, 20, 2, "ragged", True, "bcgd", (16, 16)),
    "prefill_over_cache_slots": (3, 23, 64, 0, 2, "left", True, "cache", (8, 16)),
    "chunk_over_cache_slots": (3, 13, 64, 30, 2, "left", True, "cache", (8, 16)),
    "not_causal": (4, 21, 37, 0, 2, "ragged", False, "bcgd", (8, 16)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_flash_equals_xla(name):
  b, s, c, q_offset, r, kind, causal, kv_layout, (bq, bk) = CASES[name]
  q, k, v, valid = _inputs(b, s, c, r, kind, kv_layout)
  seen_BS = _seen(valid, s, q_offset, causal)
  if kind in ("left", "ragged") and causal and q_offset == 0:
    assert not seen_BS.all()  # queries that see no key are exercised
  kw = dict(causal=causal, kv_layout=kv_layout)
  # q_offset traced (a cache index under jit) for flash, a Python int for the reference.
  off = jnp.int32(q_offset)
  flash = lambda q, k, v: attn.attention(q, k, v, valid, q_offset=off, impl="blocked", block_q=bq, block_k=bk, **kw)
  xla = lambda q, k, v: attn.attention(q, k, v, valid, q_offset=q_offset, impl="xla", **kw)
  _check(flash, xla, q, k, v, seen_BS)


@pytest.mark.parametrize("impl", ["blocked", "native"])
def test_flash_queries_that_see_no_key_pass_no_gradient_to_q_or_k(impl):
  """A query that sees no key has only constant (-1e30) scores: its output depends on v alone.
  With a loss over every query, dq there is exactly 0 and dq, dk equal xla's (dv differs: the
  implementations average different keys for such a query)."""
  q, k, v, valid = _inputs(3, 37, 37, 2, "left")
  seen_BS = _seen(valid, 37, 0, True)
  loss = lambda impl: lambda q, k, v: jnp.sum(jnp.sin(attn.attention(q, k, v, valid, impl=impl, block_q=16,
                                                                       block_k=8)))
  dq, dk, _ = jax.jit(jax.grad(loss(impl), argnums=(0, 1, 2)))(q, k, v)
  dq_x, dk_x, _ = jax.jit(jax.grad(loss("xla"), argnums=(0, 1, 2)))(q, k, v)
  assert (~seen_BS).sum() == 7 + 34 and not np.asarray(dq)[~seen_BS].any()
  for a, b in ((dq, dq_x), (dk, dk_x)):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * max(1.0, float(jnp.max(jnp.abs(b)))))


def test_flash_bf16_is_as_accurate_as_todays_bf16_path():
  """bf16 q / k / v: flash returns bf16 (output and gradients), and its distance to the float32
  computation on the same bf16 values is no larger than today's bf16 path's (within 25%):
  both differ from it only by bf16 rounding (measured: output 0.0078 each, gradients equal)."""
  q, k, v, valid = _inputs(3, 37, 37, 2, "left", dtype=jnp.bfloat16)
  seen_BS = _seen(valid, 37, 0, True)
  w = jnp.asarray(seen_BS, jnp.float32)[:, :, None, None, None]

  def run(impl, dtype):
    def loss(q, k, v):
      out = attn.attention(q.astype(dtype), k.astype(dtype), v.astype(dtype), valid, impl=impl, block_q=16,
                           block_k=16)
      return jnp.sum(jnp.sin(out.astype(jnp.float32)) * w), out
    grads, out = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return [np.asarray(x, np.float32) for x in (out, *grads)], [x.dtype for x in (out, *grads)]

  (flash, dtypes), (xla, _), (ref, _) = run("blocked", jnp.bfloat16), run("xla", jnp.bfloat16), run("xla", jnp.float32)
  assert dtypes == [jnp.bfloat16] * 4
  for i, (a, b, c) in enumerate(zip(flash, xla, ref)):
    rows = seen_BS if i == 0 else slice(None)  # the output of queries that see a key; every gradient
    assert np.isfinite(a).all()
    err_flash, err_xla = np.abs(a - c)[rows].max(), np.abs(b - c)[rows].max()
    assert 0 < err_xla and err_flash <= 1.25 * err_xla, (i, err_flash, err_xla)


def test_flash_loop_bounds_skip_exactly_the_key_blocks_above_the_diagonal():
  """Query block i reads key blocks [0, end_i): the last one holds a key its last query sees,
  the next one none; the backward's [start_j, nq) visits the same (i, j) pairs."""
  spec = attn._Blocks(bq=16, bk=8, r=2, nq=4, nk=12, causal=True)
  for q_offset in (0, 5, 20, 40):
    ends = [int(attn._key_block_end(i, q_offset, spec)) for i in range(spec.nq)]
    starts = [int(attn._query_block_start(j, q_offset, spec)) for j in range(spec.nk)]
    for i, end in enumerate(ends):
      last_slot = q_offset + (i + 1) * spec.bq - 1
      assert (end - 1) * spec.bk <= last_slot and (end == spec.nk or end * spec.bk > last_slot)
      assert [j < end for j in range(spec.nk)] == [i >= starts[j] for j in range(spec.nk)]
    if q_offset == 0:
      assert sum(ends) == 2 + 4 + 6 + 8  # of 4 x 12 pairs


def _count_eqns(jaxpr) -> int:
  """Equations of a jaxpr and of every jaxpr nested in it (loop bodies, custom-VJP rules)."""
  n = 0
  for eqn in jaxpr.eqns:
    n += 1
    for param in eqn.params.values():
      for sub in (param if isinstance(param, (tuple, list)) else (param,)):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          n += _count_eqns(sub.jaxpr)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          n += _count_eqns(sub)
  return n


def test_flash_program_does_not_grow_with_the_number_of_blocks():
  """Query x key blocks run in lax loops: 4 or 64 blocks per side trace the same program."""
  def n_eqns(s):
    q, k, v, valid = (jax.ShapeDtypeStruct(x, t) for x, t in
                      (((1, s, 1, 1, D), jnp.float32), ((1, s, 1, D), jnp.float32),
                       ((1, s, 1, D), jnp.float32), ((1, s), jnp.bool_)))
    f = lambda q, k, v, m: jnp.sum(attn.attention(q, k, v, m, impl="blocked", block_q=16, block_k=16))
    return _count_eqns(jax.make_jaxpr(jax.grad(f, argnums=(0, 1, 2)))(q, k, v, valid).jaxpr)
  assert n_eqns(64 * 16) == n_eqns(4 * 16)


def test_flash_temporaries_are_far_below_one_score_matrix():
  """fwd+bwd at S = 2048, one row, one head: xla holds [S, S] f32 scores, flash only blocks."""
  s = 2048
  spec = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  args = (spec(1, s, 1, 1, D), spec(1, s, 1, D), spec(1, s, 1, D), jax.ShapeDtypeStruct((1, s), jnp.bool_))

  def temp_bytes(impl):
    f = lambda q, k, v, m: jnp.sum(attn.attention(q, k, v, m, impl=impl))
    compiled = jax.jit(jax.grad(f, argnums=(0, 1, 2))).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  scores = s * s * 4
  optimized = jax.config.read("jax_disable_most_optimizations")
  jax.config.update("jax_disable_most_optimizations", False)  # the memory a real run sees
  try:
    xla, flash = temp_bytes("xla"), temp_bytes("blocked")
  finally:
    jax.config.update("jax_disable_most_optimizations", optimized)
  assert xla >= scores, xla
  assert flash < scores / 8, flash


def test_auto_on_cpu_is_native_for_the_no_cache_forward_else_xla_short_blocked_long(monkeypatch):
  """float32 keys over the queries themselves: native; the cache layout, or without the
  handlers: xla below 512 x 512 scores, blocked from there (bit for bit the chosen impl)."""
  assert jax.default_backend() == "cpu"

  def same(s, want, kv_layout="bcgd"):
    q, k, v, valid = _inputs(1, s, s, 1, "full", kv_layout)
    run = lambda impl: jax.jit(lambda q, k, v: attn.attention(q, k, v, valid, impl=impl, kv_layout=kv_layout))(q, k, v)
    np.testing.assert_array_equal(run("auto"), run(want))

  same(40, "native")
  same(40, "xla", "cache")
  same(512, "blocked", "cache")
  monkeypatch.setattr(attn.native_causal_attention, "usable_for", lambda *a: False)
  same(40, "xla")
  same(512, "blocked")


# The native handlers against xla on every no-cache case above, and a not-causal one over S keys.
NATIVE_CASES = {n: c for n, c in CASES.items() if c[7] == "bcgd" and c[1] == c[2] and c[3] == 0}
NATIVE_CASES["not_causal_over_the_queries"] = (4, 37, 37, 0, 2, "ragged", False, "bcgd", None)


@pytest.mark.parametrize("name", list(NATIVE_CASES))
def test_native_equals_xla(name):
  assert attn.native_causal_attention.available(), "the native training attention did not build (see the warning)"
  b, s, c, _, r, kind, causal, _, _ = NATIVE_CASES[name]
  q, k, v, valid = _inputs(b, s, c, r, kind)
  native = lambda q, k, v: attn.attention(q, k, v, valid, causal=causal, impl="native")
  xla = lambda q, k, v: attn.attention(q, k, v, valid, causal=causal, impl="xla")
  _check(native, xla, q, k, v, _seen(valid, s, 0, causal))


def test_native_under_vmap_and_split_over_a_mesh_s_batch_axis():
  """A vmapped call folds the mapped axis into the rows, and under a context mesh each device runs
  its own rows (a shard_map over the batch axes, not a gathered custom call): both bit for bit
  the plain call, output and gradients."""
  q, k, v, valid = _inputs(8, 24, 24, 2, "left", seed=3)

  def f(q, k, v, valid):  # (the loss, the output): gradients and output compared, not the summed loss
    out = attn.attention(q, k, v, valid, impl="native")
    return jnp.sum(jnp.sin(out)), out

  grad = jax.grad(f, argnums=(0, 1, 2), has_aux=True)
  want = jax.jit(grad)(q, k, v, valid)
  two = jax.jit(jax.vmap(grad))(*(jnp.stack([x, x]) for x in (q, k, v, valid)))
  for a, w in zip(jax.tree.leaves(two), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a)[1], np.asarray(w))
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "tensor"))
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  with jax.set_mesh(mesh):
    sharded = jax.jit(grad)
    args = [jax.device_put(x, rows) for x in (q, k, v, valid)]
    text = sharded.lower(*args).as_text()
    got = sharded(*args)
  assert "sdy.manual_computation" in text or "shard_map" in text, text[:3000]
  assert attn.native_causal_attention.FWD_TARGET in text and attn.native_causal_attention.BWD_TARGET in text
  for a, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(w))


def test_native_asked_for_where_it_cannot_serve_falls_back_to_auto_warning_once():
  q, k, v, valid = _inputs(3, 23, 64, 2, "left", "cache")
  attn._WARNED.difference_update({x for x in attn._WARNED if x.startswith("native")})
  want = jax.jit(lambda q, k, v: attn.attention(q, k, v, valid, kv_layout="cache"))(q, k, v)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for _ in range(2):  # two traces: the second must not warn again
      got = jax.jit(lambda q, k, v: attn.attention(q, k, v, valid, kv_layout="cache", impl="native"))(q, k, v)
      np.testing.assert_array_equal(got, want)
  ours = [str(w.message) for w in caught if "impl='native'" in str(w.message)]
  assert len(ours) == 1 and "no-cache forward only" in ours[0], ours


@pytest.mark.parametrize("impl", ["cudnn", "splash"])
def test_gpu_and_tpu_kernels_fall_back_to_flash_on_cpu_warning_once(impl):
  q, k, v, valid = _inputs(3, 37, 37, 2, "left")
  attn._WARNED.difference_update({x for x in attn._WARNED if x.startswith(impl)})
  want = jax.jit(lambda q, k, v: attn.attention(q, k, v, valid, impl="blocked"))(q, k, v)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for _ in range(2):  # two traces: the second must not warn again
      got = attn.attention(q, k, v, valid, impl=impl)
      np.testing.assert_array_equal(got, want)
  ours = [w for w in caught if issubclass(w.category, RuntimeWarning) and f"impl={impl!r}" in str(w.message)]
  assert len(ours) == 1, [str(w.message) for w in caught]
  assert "falls back to 'blocked'" in str(ours[0].message) and "backend is 'cpu'" in str(ours[0].message)


@pytest.mark.parametrize("kind,c,kv_layout", [("ragged", 37, "bcgd"), ("left", 50, "cache")])
def test_cudnn_wiring_equals_flash(kind, c, kv_layout):
  """The cuDNN path's rotation to right padding + sequence lengths, run through jax's XLA
  implementation of the same dot_product_attention call (cuDNN itself needs a GPU). A mask
  that is not one run per row (the ragged case's holes) takes the lax.cond to flash."""
  q, k, v, valid = _inputs(4, 37, c, 2, kind, kv_layout)
  _, _, ok = attn._contiguous_runs(valid)
  assert bool(ok) == (kind != "ragged")
  flash = functools.partial(attn._blocked_attention, block_q=16, block_k=16)
  if kind == "ragged":
    # The holes take the flash branch: the same numbers as flash itself.
    got = jax.jit(lambda q, k, v: attn._cudnn_attention(q, k, v, valid, 0, True, kv_layout, fallback=flash,
                                                        sdpa_impl="xla"))(q, k, v)
    np.testing.assert_array_equal(got, jax.jit(lambda q, k, v: flash(q, k, v, valid, 0, True, kv_layout))(q, k, v))
    # Without row 3's holes, left, right and both-sides padded rows run the cuDNN branch.
    valid = valid.at[3].set(True)
    assert bool(attn._contiguous_runs(valid)[2])
  cudnn = lambda q, k, v: attn._cudnn_attention(q, k, v, valid, 0, True, kv_layout, fallback=flash, sdpa_impl="xla")
  want = lambda q, k, v: attn.attention(q, k, v, valid, impl="xla", kv_layout=kv_layout)
  _check(cudnn, want, q, k, v, _seen(valid, 37, 0, True))


@pytest.mark.parametrize("s,c,q_offset,kind", [(100, 100, 0, "ragged"), (40, 130, 70, "left")])
def test_splash_kernel_in_interpret_mode_equals_xla(s, c, q_offset, kind):
  """The TPU splash kernel through the Pallas interpreter on CPU: causal mask offset, segment
  ids for the key mask, GQA heads, S and C padded to 128."""
  q, k, v, valid = _inputs(4, s, c, 2, kind)
  splash = lambda q, k, v: attn._splash_attention(q, k, v, valid, q_offset, True, "bcgd", interpret=True)
  xla = lambda q, k, v: attn.attention(q, k, v, valid, q_offset=q_offset, impl="xla")
  _check(splash, xla, q, k, v, _seen(valid, s, q_offset, True))


def test_flash_is_a_deprecated_alias_of_blocked():
  q, k, v, valid = _inputs(3, 40, 40, 2, "left")
  attn._WARNED.discard("flash")
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    got = attn.attention(q, k, v, valid, impl="flash")
  assert any(issubclass(w.category, DeprecationWarning) and "'blocked'" in str(w.message) for w in caught)
  np.testing.assert_array_equal(got, attn.attention(q, k, v, valid, impl="blocked"))


# auto_impl is a pure function of (backend, dtype, shapes, offset): what each program runs per
# backend. (backend, dtype, B, S, C, static zero offset, static offset, head dim) -> impl.
_AUTO_CASES = [
    # GPU, 16-bit, static offset 0: cuDNN (training S x S, and the sampler's prefill S < C).
    ("gpu", "bfloat16", 8, 2048, 2048, True, True, 128, "cudnn"),
    ("gpu", "float16", 32, 1023, 2048, True, True, 128, "cudnn"),
    # GPU, float32 (the tiny configs) or a traced offset: xla (blocked ran 1.8-2x slower on an
    # H200), unless xla's f32 scores would pass _AUTO_MAX_SCORE_BYTES: blocked.
    ("gpu", "float32", 8, 2048, 2048, True, True, 128, "xla"),
    ("gpu", "bfloat16", 8, 64, 2048, False, False, 128, "xla"),
    ("gpu", "float32", 8, 32768, 32768, True, True, 128, "blocked"),
    ("gpu", "bfloat16", 1, 2048, 2048, True, True, 100, "xla"),  # head dim not a multiple of 8
    ("gpu", "bfloat16", 1, 2048, 2048, True, True, 512, "xla"),  # head dim past cuDNN's 256
    # TPU: splash wherever the offset is static; a traced one: xla / blocked by memory.
    ("tpu", "bfloat16", 8, 2048, 2048, True, True, 128, "splash"),
    ("tpu", "float32", 8, 40, 2048, False, True, 128, "splash"),
    ("tpu", "bfloat16", 8, 40, 2048, False, False, 128, "xla"),
    # CPU: xla below 512 x 512 scores, blocked from there (the bench_attention measurements);
    # native wherever it serves (the `native` argument, True in the rows marked so below).
    ("cpu", "bfloat16", 8, 40, 40, True, True, 128, "xla"),
    ("cpu", "float32-native", 8, 40, 40, True, True, 32, "native"),
    ("cpu", "float32-native", 1, 2048, 2048, True, True, 32, "native"),
    ("gpu", "float32-native", 8, 2048, 2048, True, True, 128, "xla"),  # native is CPU's only
    ("cpu", "float32", 1, 512, 512, True, True, 16, "blocked"),
    ("cpu", "float32", 1, 511, 512, True, True, 16, "xla"),
]


@pytest.mark.parametrize("backend,dtype,b,s,c,zero,static,d,want", _AUTO_CASES)
def test_auto_impl_per_backend_dtype_and_shape(backend, dtype, b, s, c, zero, static, d, want):
  native = dtype.endswith("-native")
  got = attn.auto_impl(backend, jnp.dtype(dtype.removesuffix("-native")), b, s, c, 32, d, static_zero_offset=zero,
                       static_offset=static, native=native)
  assert got == want


def test_auto_impl_memory_rule_is_the_f32_score_buffer():
  """GPU, float32: xla up to _AUTO_MAX_SCORE_BYTES of [B, H, S, C] f32 scores, blocked past it."""
  h, s = 32, 4096
  b_fit = attn._AUTO_MAX_SCORE_BYTES // (4 * h * s * s)
  auto = lambda b: attn.auto_impl("gpu", jnp.dtype("float32"), b, s, s, h, 128, static_zero_offset=True,
                                  static_offset=True)
  assert auto(b_fit) == "xla" and auto(b_fit + 1) == "blocked"


def test_the_chosen_implementation_is_recorded_at_trace_time():
  from rl_jax import impl_log
  q, k, v, valid = _inputs(3, 40, 40, 2, "left")
  with impl_log.recording() as log:
    jax.jit(lambda q, k, v: attn.attention(q, k, v, valid))(q, k, v)
    jax.jit(lambda q, k, v: attn.attention(q, k, v, valid, impl="blocked"))(q, k, v)
  assert log["attention"] == {"native": 1, "blocked": 1}


def test_splash_kernel_lowers_for_tpu_from_this_host():
  """The splash path lowered for TPU (Mosaic) on a CPU host: the real kernel, not the interpreter.
  Skipped only where this jax cannot lower for a TPU without one (named in the skip)."""
  q = jax.ShapeDtypeStruct((2, 256, 2, 2, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 256, 2, 128), jnp.bfloat16)
  valid = jax.ShapeDtypeStruct((2, 256), jnp.bool_)
  f = lambda q, k, v, valid: attn._splash_attention(q, k, v, valid, 0, True, "bcgd")
  try:
    text = jax.jit(f).trace(q, kv, kv, valid).lower(lowering_platforms=("tpu",)).as_text()
  except Exception as exc:  # pylint: disable=broad-except
    pytest.skip(f"jax {jax.__version__} does not lower a Pallas TPU kernel on a CPU host: "
                f"{type(exc).__name__}: {str(exc)[:200]}")
  assert "tpu_custom_call" in text, text[:2000]
