"""The recording's top-k (rl_jax/ops/topk.py) is lax.top_k bit for bit: values, ids, tie order."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax.ops import topk
from rl_jax.sampler import decode


def _assert_same(got, want):
  np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
  # Bits, not values: -0.0 against 0.0 and NaN payloads must match too.
  np.testing.assert_array_equal(np.asarray(got[0]).view(np.int32), np.asarray(want[0]).view(np.int32))


def _cases(x):
  return {"plain": x, "log_softmax": jax.nn.log_softmax(x), "many ties": jnp.round(2 * x),
          "-inf ties": jnp.where(x > 0, -jnp.inf, x), "signed zeros": jnp.where(x > 0, -0.0, 0.0),
          "NaNs": jnp.where(x > 1.5, jnp.nan, x), "all equal (fallback)": jnp.zeros_like(x)}


def _assert_every_case(fn, x, k):
  for name, arr in _cases(x).items():
    try:
      _assert_same(fn(arr), jax.lax.top_k(arr, k))
    except AssertionError as e:
      raise AssertionError(f"case {name}") from e


@pytest.mark.parametrize("b,v,k", [pytest.param(32, 4096, 128, marks=pytest.mark.slow),
                                     pytest.param(3, 5000, 16, marks=pytest.mark.slow), (2, 65, 8)])
def test_threshold_top_k_equals_lax_top_k(b, v, k):
  """Every case, including ones that take the lax.top_k fallback (all equal: every element
  reaches the threshold) and sizes without chunks (V < 8k)."""
  x = 3 * jax.random.normal(jax.random.key(v), (b, v))
  _assert_every_case(jax.jit(lambda x: topk.threshold_top_k(x, k)), x, k)


def test_threshold_top_k_takes_the_small_path_on_iid_rows():
  """The fast path is the one tested above on plain rows: about 1.15k elements reach the bound,
  within the 2k slots (the fallback would make the test above vacuous for them)."""
  x = 3 * jax.random.normal(jax.random.key(0), (32, 4096))
  key_BNC = topk.order_key(x).reshape(32, 512, 8)
  lower_B = topk._kth_largest(jnp.max(key_BNC, axis=-1).T, 128)  # pylint: disable=protected-access
  n_B = np.asarray(jnp.sum(key_BNC >= lower_B[:, None, None], axis=(1, 2)))
  assert (n_B >= 128).all() and (n_B <= 256).all(), n_B


def test_order_key_round_trip_and_order():
  vals = np.array([-np.inf, -3.5, -1e-38, -0.0, 0.0, 1e-38, 2.0, np.inf], np.float32)
  key = np.asarray(topk.order_key(jnp.asarray(vals)))
  assert (np.diff(key) > 0).all()
  back = np.asarray(topk.from_order_key(jnp.asarray(key)))
  np.testing.assert_array_equal(back.view(np.int32), vals.view(np.int32))


def test_bitonic_sort_is_a_stable_descending_sort():
  key = jax.random.randint(jax.random.key(1), (64, 5), -3, 3)  # many ties: index order decides
  idx = jnp.broadcast_to(jnp.arange(64)[:, None], (64, 5))
  got_key, got_idx = jax.jit(topk.bitonic_sort)(key, idx)
  want = np.argsort(-np.asarray(key), axis=0, kind="stable")
  np.testing.assert_array_equal(got_idx, want)
  np.testing.assert_array_equal(got_key, np.take_along_axis(np.asarray(key), want, axis=0))


def test_recorded_top_k_is_lax_top_k():
  x = jax.nn.log_softmax(jax.random.normal(jax.random.key(2), (8, 2048)))
  _assert_same(jax.jit(lambda x: decode.recorded_top_k(x, 64))(x), jax.lax.top_k(x, 64))


def test_top_half_is_the_first_half_of_the_sort():
  key = jax.random.randint(jax.random.key(3), (32, 5), -3, 3)
  idx = jnp.broadcast_to(jnp.arange(32)[:, None], (32, 5))
  got_key, got_idx = jax.jit(topk.top_half)(key, idx)
  want = np.argsort(-np.asarray(key), axis=0, kind="stable")[:16]
  np.testing.assert_array_equal(got_idx, want)
  np.testing.assert_array_equal(got_key, np.take_along_axis(np.asarray(key), want, axis=0))


NATIVE_SIZES = [(32, 4096, 128), (2, 65, 8), (2, 64, 8), (3, 5000, 1), (2, 40, 40), (2, 152064, 128)]


@pytest.mark.parametrize("b,v,k", NATIVE_SIZES)
def test_native_top_k_equals_lax_top_k(b, v, k):
  """The native handler (built here: CI has a C++ compiler) is lax.top_k bit for bit on every case,
  k = 1 and k = V included, and under vmap (leading axes are rows)."""
  from rl_jax.ops import native_topk  # pylint: disable=g-import-not-at-top
  assert native_topk.available(), "the native top-k did not build (see the warning above)"
  x = 3 * jax.random.normal(jax.random.key(v + k), (b, v))
  _assert_every_case(jax.jit(lambda x: native_topk.top_k(x, k)), x, k)
  stacked = jnp.stack([x, -x])
  _assert_same(jax.vmap(lambda r: native_topk.top_k(r, k))(stacked), jax.lax.top_k(stacked, k))


def test_recorded_top_k_takes_the_native_handler_on_cpu(monkeypatch):
  """The recording goes through the handler on CPU (its custom call in the program), not XLA's top-k
  (`chlo.top_k`, which the same program holds when the handler is not usable)."""
  from rl_jax.ops import native_topk  # pylint: disable=g-import-not-at-top
  lowered = lambda: jax.jit(lambda x: decode.recorded_top_k(x, 8)).lower(jnp.zeros((4, 64))).as_text()
  text = lowered()
  assert "rl_jax_topk_f32" in text and "chlo.top_k" not in text
  monkeypatch.setattr(native_topk, "usable_for", lambda x: False)
  text = lowered()
  assert "rl_jax_topk_f32" not in text and "chlo.top_k" in text


def test_native_build_failure_is_named_and_leaves_no_library(tmp_path, monkeypatch):
  """A failing compiler raises with its command (and `available()` then falls back to lax.top_k);
  nothing half-written is left under the library's name."""
  from rl_jax.ops import native_topk  # pylint: disable=g-import-not-at-top
  monkeypatch.setenv("CXX", "false")
  with pytest.raises(RuntimeError, match="building the native top-k failed"):
    native_topk.build(str(tmp_path / "topk.so"))
  assert not list(tmp_path.iterdir())
