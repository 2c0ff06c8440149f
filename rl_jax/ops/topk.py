"""Exact top-k for the sampler's recording: `lax.top_k`'s output bit for bit, by a threshold and a small sort on CPU."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# XLA:CPU runs `lax.top_k` as one single-threaded custom call (a partial sort with a k-heap per
# row): at B = 32, V = 4096, k = 128 it takes ~1.4 ms, a third of a decode step of the peer
# benchmark's models (docs/performance.md). `threshold_top_k` gets the same output from
# vectorized passes: a lower bound L on the k-th largest value (the k-th largest of chunk
# maxima), the few elements >= L gathered into M = 2k slots, and a bitonic sort of those slots
# whose compare-exchanges run across the batch (the minor axis), so every one is a vector op.
# Alone it is 1.2x faster than the custom call; inside the decode loop it cut recording's overhead
# on the dense model only (docs/performance.md), so `decode.recorded_top_k` does not call it by default.

_INT_MIN = np.int32(np.iinfo(np.int32).min)
_BITS = 20


def order_key(x: jax.Array) -> jax.Array:
  """int32 keys in `lax.top_k`'s order of float32 values: a total order (-0.0 < 0.0, NaNs at the
  ends by sign) with `key(a) > key(b)` iff a comes first; XLA:CPU's TopK compares these very keys."""
  bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
  return jnp.where(bits < 0, bits ^ np.int32(0x7FFFFFFF), bits)


def from_order_key(key: jax.Array) -> jax.Array:
  """The float32 values of `order_key` keys (the map is its own inverse on the bits)."""
  return jax.lax.bitcast_convert_type(jnp.where(key < 0, key ^ np.int32(0x7FFFFFFF), key), jnp.float32)


def _chunk(v: int, k: int) -> int:
  """Chunk size c (a power of two) with >= 4k chunks; 0 when V < 8k (the plain op then)."""
  c = 1
  while v // (2 * c) >= 4 * k:
    c *= 2
  return c if c >= 2 else 0


def _kth_largest(key_NB: jax.Array, k: int, bits: int = 32) -> jax.Array:
  """A lower bound on the k-th largest key of each column of [N, B], exact with `bits` = 32:
  the key's top `bits` bits found by halving the unsigned key range, each halving one
  compare-and-count over the column (a reduction over the major axis: vector adds of [B] rows)."""
  u_NB = jax.lax.bitcast_convert_type(key_NB, jnp.uint32) ^ np.uint32(0x80000000)
  t_B = jnp.zeros(key_NB.shape[1:], jnp.uint32)
  for bit in range(31, 31 - bits, -1):
    cand_B = t_B | np.uint32(1 << bit)
    n_B = jnp.sum(u_NB >= cand_B[None, :], axis=0, dtype=jnp.int32)
    t_B = jnp.where(n_B >= k, cand_B, t_B)
  return jax.lax.bitcast_convert_type(t_B ^ np.uint32(0x80000000), jnp.int32)


def _cumsum(x: jax.Array) -> jax.Array:
  """Inclusive prefix sum over the last axis by log2(n) shifted adds: XLA:CPU lowers
  `jnp.cumsum` to a reduce-window that costs O(n * window) (155 us for [32, 256, 8]
  in a loop)."""
  n = x.shape[-1]
  shift = 1
  while shift < n:
    pad = jnp.zeros(x.shape[:-1] + (shift,), x.dtype)
    # The barrier keeps each step one fusion (fused, the steps recompute their inputs).
    x = jax.lax.optimization_barrier(x + jnp.concatenate([pad, x[..., :n - shift]], axis=-1))
    shift *= 2
  return x


def _compare_exchange(ka, ia, kb, ib):
  """(a, b) -> (first, second) in `lax.top_k`'s order: key descending, then index ascending."""
  a_first = (ka > kb) | ((ka == kb) & (ia < ib))
  return (jnp.where(a_first, ka, kb), jnp.where(a_first, ia, ib),
          jnp.where(a_first, kb, ka), jnp.where(a_first, ib, ia))


def _merge_stages(key_MB, idx_MB, size: int):
  """The compare-exchange stages that turn each bitonic block of `size` rows into a sorted one
  (descending where (row // size) is even, ascending where odd)."""
  m, b = key_MB.shape
  stride = size // 2
  while stride >= 1:
    shape = (m // (2 * stride), 2, stride, b)
    k4, i4 = key_MB.reshape(shape), idx_MB.reshape(shape)
    fk, fi, sk, si = _compare_exchange(k4[:, 0], i4[:, 0], k4[:, 1], i4[:, 1])
    up = jnp.asarray((np.arange(m // (2 * stride)) * 2 * stride // size) % 2 == 1)[:, None, None]
    key_MB = jnp.stack([jnp.where(up, sk, fk), jnp.where(up, fk, sk)], axis=1).reshape(m, b)
    idx_MB = jnp.stack([jnp.where(up, si, fi), jnp.where(up, fi, si)], axis=1).reshape(m, b)
    # One fusion per stage: XLA:CPU otherwise fuses stages into kernels that recompute
    # their inputs (5x slower at M = 256).
    key_MB, idx_MB = jax.lax.optimization_barrier((key_MB, idx_MB))
    stride //= 2
  return key_MB, idx_MB


def bitonic_sort(key_MB: jax.Array, idx_MB: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Sorts each column of [M, B] (M a power of two) by (key desc, index asc): a bitonic network
  along axis 0, so each compare-exchange is an elementwise op over whole [*, B] rows."""
  m = key_MB.shape[0]
  size = 2
  while size <= m:
    key_MB, idx_MB = _merge_stages(key_MB, idx_MB, size)
    size *= 2
  return key_MB, idx_MB


def top_half(key_MB: jax.Array, idx_MB: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The first M/2 of each column of [M, B] in (key desc, index asc) order: the two halves
  sorted side by side as [M/2, 2B], then one merge (the larger of a_i and b_(M/2-1-i) is
  a bitonic sequence holding the top M/2) instead of sorting all M."""
  m, b = key_MB.shape
  h = m // 2
  side = lambda x: x.reshape(2, h, b).transpose(1, 0, 2).reshape(h, 2 * b)
  key_HB, idx_HB = bitonic_sort(side(key_MB), side(idx_MB))
  fk, fi, _, _ = _compare_exchange(key_HB[:, :b], idx_HB[:, :b], key_HB[::-1, b:], idx_HB[::-1, b:])
  return _merge_stages(fk, fi, h)


def threshold_top_k(x_BV: jax.Array, k: int, slots: int | None = None) -> tuple[jax.Array, jax.Array]:
  """`lax.top_k(x_BV, k)` bit for bit (values, ids, tie order; float32 values).

  Exact whatever the data: the elements >= L (L = the k-th largest of the V / c chunk maxima,
  so >= k elements reach it and every top-k element does) are gathered into `slots` (default
  2k) and sorted; a batch where some row has more than `slots` of them takes `lax.top_k`
  instead (a `lax.cond`). For iid values about 1.15k elements reach L at V / c = 4k chunks.
  """
  b, v = x_BV.shape
  c = _chunk(v, k)
  m = slots or 2 * k
  if not c or m & (m - 1) or m < k:
    return tuple(jax.lax.top_k(x_BV.astype(jnp.float32), k))
  x_BV = x_BV.astype(jnp.float32)
  n = -(-v // c)
  key_BV = order_key(x_BV)
  if n * c != v:  # padding keys sort after every real one (INT_MIN, and a larger index)
    key_BV = jnp.concatenate([key_BV, jnp.full((b, n * c - v), _INT_MIN, jnp.int32)], axis=1)
  key_BNC = key_BV.reshape(b, n, c)
  lower_B = _kth_largest(jnp.max(key_BNC, axis=-1).T, k, _BITS)
  cand_BNC = key_BNC >= lower_B[:, None, None]
  count_BN = jnp.sum(cand_BNC, axis=-1, dtype=jnp.int32)
  cum_BN = _cumsum(count_BN)
  total_B = cum_BN[:, -1]

  def small(_):
    # Slot s holds the (s+1)-th candidate in index order: chunk j = first with cum >= s + 1,
    # then the r-th candidate inside it, r = s - (candidates before chunk j).
    want_BM = jnp.broadcast_to(jnp.arange(1, m + 1, dtype=jnp.int32), (b, m))
    # Chunk of slot s = the number of chunks whose candidates all sit before it, i.e. with
    # cum <= s: a histogram of cum (a scatter-add of N ones, cum >= m dropped), summed up.
    hist_BM = jax.vmap(lambda cum_N: jnp.zeros((m,), jnp.int32).at[cum_N].add(1, mode="drop"))(cum_BN)
    j_BM = jnp.minimum(_cumsum(hist_BM), n - 1)
    r_BM = want_BM - (jnp.take_along_axis(cum_BN, j_BM, axis=-1) - jnp.take_along_axis(count_BN, j_BM, axis=-1))
    keys_BMC = jnp.take_along_axis(key_BNC, j_BM[:, :, None], axis=1)
    in_BMC = keys_BMC >= lower_B[:, None, None]
    at_BMC = in_BMC & (_cumsum(in_BMC.astype(jnp.int32)) == r_BM[:, :, None])
    pos_BM = jnp.sum(jnp.where(at_BMC, jnp.arange(c, dtype=jnp.int32), 0), axis=-1)
    key_BM = jnp.max(jnp.where(at_BMC, keys_BMC, _INT_MIN), axis=-1)
    real_BM = want_BM <= total_B[:, None]
    key_BM = jnp.where(real_BM, key_BM, _INT_MIN)
    idx_BM = jnp.where(real_BM, j_BM * c + pos_BM, n * c + jnp.arange(m, dtype=jnp.int32))
    key_MB, idx_MB = top_half(key_BM.T, idx_BM.T) if m == 2 * k else bitonic_sort(key_BM.T, idx_BM.T)
    return from_order_key(key_MB[:k].T), idx_MB[:k].T

  return jax.lax.cond(jnp.all(total_B <= m), small, lambda _: tuple(jax.lax.top_k(x_BV, k)), None)
