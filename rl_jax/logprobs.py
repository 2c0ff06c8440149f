"""Log-prob math shared by the sampler, the trainer and SFT: log q, gathered log-probs, entropy."""
from __future__ import annotations

import functools

import jax
from jax.custom_derivatives import SymbolicZero
import jax.numpy as jnp
import numpy as np

sg = jax.lax.stop_gradient


def next_token_logq(logits_BV: jax.Array, temperature: float) -> jax.Array:
  """`log q(. | prefix)`: log-softmax of the temperature-scaled full-vocabulary logits.

  The same arithmetic as the trainer's `gather_logprobs`, z - (max + log sum exp(z - max)) with
  z = logits * (1 / temperature): on equal logits at temperature 1 the two agree bit for bit (the
  zero-mismatch mode, docs/math.md#zero-mismatch-mode), where `jax.nn.log_softmax`'s
  (z - max) - log sum differs by an ulp.
  """
  lead, v = logits_BV.shape[:-1], logits_BV.shape[-1]
  logits_NV = logits_BV.reshape(-1, v)
  inv_temp = 1.0 / float(temperature)
  lse_N, _ = _lse_entropy(logits_NV, inv_temp)
  return (_scaled(logits_NV, inv_temp) - lse_N[:, None]).reshape(*lead, v)


def token_logprobs(logits_BSV: jax.Array, targets_BS: jax.Array, temperature: float = 1.0) -> jax.Array:
  """`log softmax(logits / temperature)[target]` at every slot, float32 (the sampler's log q form)."""
  logp_BSV = next_token_logq(logits_BSV, temperature)
  return jnp.take_along_axis(logp_BSV, targets_BS[..., None], axis=-1)[..., 0]


# --- Log-probs at a few ids without a second [B, T, V] tensor ------------------------------

# Where a logit is -inf (a masked vocabulary slot), p = 0 and log p = -inf; clamping log p
# to a finite floor keeps p * log p at 0 instead of 0 * -inf = NaN, without a select.
_LOGP_FLOOR = -1e30


def _scaled(logits: jax.Array, inv_temp: float) -> jax.Array:
  """float32 logits / temperature (as a product with 1 / temperature)."""
  return logits.astype(jnp.float32) * inv_temp


def _lse_entropy(logits_NV: jax.Array, inv_temp: float):
  """logsumexp and entropy of softmax(logits * inv_temp), float32, as reductions over V.

  H = lse - sum_v p_v z_v = log s - sum_v e_v (z_v - m) / s with e = exp(z - m), s = sum e:
  only reductions of elementwise expressions of the logits.
  """
  # The max is taken on the logits in their own dtype (exact, and inv_temp > 0 commutes with
  # it), so no float32 copy of a bf16 [N, V] input is made just to feed this reduction.
  m_N1 = sg(_scaled(jnp.max(logits_NV, axis=-1, keepdims=True), inv_temp))
  z = _scaled(logits_NV, inv_temp)
  zc = jnp.maximum(z - m_N1, _LOGP_FLOOR)
  e = jnp.exp(zc)
  # Both sums in one variadic reduction: one pass over V that reads the logits and keeps
  # e and e * zc in registers (two separate reductions make XLA:CPU materialize them).
  s_N, ez_N = jax.lax.reduce((e, e * zc), (np.float32(0), np.float32(0)),
                             lambda a, b: (a[0] + b[0], a[1] + b[1]), (1,))
  log_s = jnp.log(s_N)
  return m_N1[:, 0] + log_s, log_s - ez_N / s_N


def _gather_impl(logits_NV, ids_NK, inv_temp):
  lse_N, ent_N = _lse_entropy(logits_NV, inv_temp)
  picked = _scaled(jnp.take_along_axis(logits_NV, ids_NK, axis=-1), inv_temp)
  return (picked - lse_N[:, None], ent_N), (lse_N, ent_N)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _gather_logprobs_2d(logits_NV, ids_NK, inv_temp):
  return _gather_impl(logits_NV, ids_NK, inv_temp)[0]


def _gather_fwd(logits_NV, ids_NK, inv_temp):
  # symbolic_zeros=True: primals arrive wrapped, so the backward can tell which outputs
  # actually carry a cotangent (the entropy usually does not: it is a diagnostic).
  logits_NV, ids_NK = logits_NV.value, ids_NK.value
  out, (lse_N, ent_N) = _gather_impl(logits_NV, ids_NK, inv_temp)
  return out, (logits_NV, ids_NK, lse_N, ent_N)


def _gather_bwd(inv_temp, res, cts):
  """d/dz_j of log p_k = [j = id_k] - p_j;  d/dz_j of H = -p_j (log p_j + H).

  One elementwise pass over V builds the dense part, then the K gathered cotangents are
  scattered in (repeated ids add up). The temperature is folded into the [N] / [N, K]
  coefficients, and a symbolically-zero cotangent skips its term entirely.
  """
  logits_NV, ids_NK, lse_N, ent_N = res
  g_NK, g_ent_N = cts
  has_lp = not isinstance(g_NK, SymbolicZero)
  has_ent = not isinstance(g_ent_N, SymbolicZero)
  if not (has_lp or has_ent):
    return None, None
  logp = logits_NV.astype(jnp.float32) * inv_temp - lse_N[:, None]
  p = jnp.exp(logp)
  if has_lp:
    dense = p * (-inv_temp * jnp.sum(g_NK, axis=-1, keepdims=True))
  else:
    dense = jnp.zeros(p.shape, jnp.float32)
  if has_ent:
    c_N1 = (-inv_temp * g_ent_N)[:, None]
    dense = dense + c_N1 * p * (jnp.maximum(logp, _LOGP_FLOOR) + ent_N[:, None])
  if has_lp:
    rows = jnp.arange(ids_NK.shape[0])[:, None]
    dense = dense.at[rows, ids_NK].add(inv_temp * g_NK)
  return dense.astype(logits_NV.dtype), None


_gather_logprobs_2d.defvjp(_gather_fwd, _gather_bwd, symbolic_zeros=True)


def gather_logprobs(logits_XV: jax.Array, ids_XK: jax.Array,
                    temperature: float = 1.0) -> tuple[jax.Array, jax.Array]:
  """log softmax(logits / temperature) at `ids`, and the entropy, for any leading shape X.

  docs/math.md#log-prob-conventions: the trainer's logits are temperature-scaled exactly as the
  sampler's were before its log-softmax. Computed in float32 whatever the logits' dtype.
  A custom VJP keeps the memory at one [X, V] float32 tensor (the gradient): the forward is
  reductions plus a K-wide gather, the backward one fused pass plus a K-wide scatter.

  Returns:
    logp_XK float32 and entropy_X float32 (both differentiable).
  """
  lead, v = logits_XV.shape[:-1], logits_XV.shape[-1]
  k = ids_XK.shape[-1]
  if ids_XK.shape[:-1] != lead:
    raise ValueError(f"ids {ids_XK.shape} do not match logits {logits_XV.shape}")
  logp_NK, ent_N = _gather_logprobs_2d(logits_XV.reshape(-1, v),
                                       ids_XK.reshape(-1, k).astype(jnp.int32),
                                       1.0 / float(temperature))
  return logp_NK.reshape(*lead, k), ent_N.reshape(lead)


def kept_set(logp_XV: jax.Array, thresh_X: jax.Array, head_ids_XH: jax.Array | None = None,
             head_kept_XH: jax.Array | None = None, covered_X: jax.Array | None = None) -> jax.Array:
  """The trainer's rebuild of the sampler's kept set K at each position, a bool [X, V] mask.

  docs/math.md#truncated-sampling. Where the sampler's recorded head H holds all of K
  (`covered_X`: |K| <= len(H)), K is exactly the head entries it kept (`head_kept_XH`, its
  log q >= tau), whatever p says. Elsewhere K is rebuilt by the threshold on the trainer's own
  log-probs, {v : log p_v >= tau}, plus every head entry (all of H is kept there).
  """
  keep_XV = logp_XV >= thresh_X[..., None]
  if head_ids_XH is None:
    return keep_XV
  n, v = int(np.prod(logp_XV.shape[:-1])), logp_XV.shape[-1]
  rows = jnp.arange(n)[:, None]
  head_NV = jnp.zeros((n, v), bool).at[rows, head_ids_XH.reshape(n, -1)].set(
      head_kept_XH.reshape(n, -1)).reshape(keep_XV.shape)
  return jnp.where(covered_X[..., None], head_NV, keep_XV | head_NV)


def truncated_logprobs(logits_XV: jax.Array, ids_XK: jax.Array, temperature: float, thresh_X: jax.Array,
                       head_ids_XH: jax.Array | None = None, head_kept_XH: jax.Array | None = None,
                       covered_X: jax.Array | None = None):
  """`gather_logprobs` of the trainer's policy truncated to the sampler's kept set and renormalized.

  log p~_k = log p_k - log p(K) on K (`kept_set`), its entropy, with the gradient of a fixed K
  (the set is piecewise constant in the logits). Returns (logp_XK, entropy_X, in_XK, log_mass_X):
  `in_XK` says which ids lie in K; outside it p~ is 0, and logp_XK holds the finite, gradient-free
  log p_k - log p(K) there so that callers can mask the entry (a token outside K is counted and
  masked by the loss, never weighted). log_mass_X = log p(K). A position whose rebuilt K is empty
  (p below the threshold everywhere) gets in_XK False and the full distribution's values.
  """
  logp_XV = sg(next_token_logq(logits_XV, temperature))
  keep_XV = kept_set(logp_XV, thresh_X, head_ids_XH, head_kept_XH, covered_X)
  empty_X = ~jnp.any(keep_XV, axis=-1)
  in_XK = jnp.take_along_axis(keep_XV, ids_XK, axis=-1) & ~empty_X[..., None]
  keep_XV = keep_XV | empty_X[..., None]  # no -inf-only row: its lse would be NaN
  masked_XV = jnp.where(keep_XV, logits_XV, jnp.asarray(-jnp.inf, logits_XV.dtype))
  lp_XK, ent_X = gather_logprobs(masked_XV, ids_XK, temperature)
  log_mass_X = jax.nn.logsumexp(jnp.where(keep_XV, logp_XV, -jnp.inf), axis=-1)
  fallback_XK = jnp.take_along_axis(logp_XV, ids_XK, axis=-1) - log_mass_X[..., None]
  return jnp.where(in_XK, lp_XK, fallback_XK), ent_X, in_XK, log_mass_X


def chunked_logprobs(hidden_BTD: jax.Array, w_unembed_DV: jax.Array, ids_BTK: jax.Array,
                     temperature: float, chunk_size: int, trunc: tuple | None = None) -> tuple[jax.Array, ...]:
  """gather_logprobs(hidden @ W, ids) computed over the sequence in chunks.

  Each chunk's logits [B, chunk, V] are made inside `lax.scan` under `jax.checkpoint`, so
  neither the forward nor the backward keeps more than one chunk of logits alive: the
  backward recomputes a chunk's logits from its hidden states. T is padded up to a whole
  number of chunks; the pad is sliced off. chunk_size = 0 (or >= T) is one chunk.
  `trunc`: `truncated_logprobs`' per-position arguments (thresh_BT, head_ids_BTH, head_kept_BTH,
  covered_BT; the head ones may be None), and then its four outputs are returned.
  """
  b, t, d = hidden_BTD.shape

  def one_chunk(h_BcD, ids_BcK, *trunc_c):
    logits = jnp.einsum("bcd,dv->bcv", h_BcD, w_unembed_DV,
                        preferred_element_type=jnp.float32)
    if trunc is None:
      return gather_logprobs(logits, ids_BcK, temperature)
    return truncated_logprobs(logits, ids_BcK, temperature, *trunc_c)

  xs = (ids_BTK,) + (tuple(trunc) if trunc is not None else ())
  if chunk_size <= 0 or chunk_size >= t:
    return one_chunk(hidden_BTD, *xs)
  n = -(-t // chunk_size)
  pad = n * chunk_size - t

  def split(x):  # [B, T, ...] -> [n, B, chunk, ...]
    if x is None:
      return None
    x = jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
    return x.reshape(b, n, chunk_size, *x.shape[2:]).swapaxes(0, 1)

  body = jax.checkpoint(one_chunk, policy=jax.checkpoint_policies.nothing_saveable)

  def step(carry, xs_c):
    return carry, body(*xs_c)

  _, outs = jax.lax.scan(step, None, (split(hidden_BTD),) + tuple(split(x) for x in xs))
  # [n, B, chunk, ...] -> [B, T, ...]
  return tuple(o.swapaxes(0, 1).reshape(b, n * chunk_size, *o.shape[3:])[:, :t] for o in outs)
