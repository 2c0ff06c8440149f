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

  The trainer must compute `log p` with this same function (docs/math.md#log-prob-conventions).
  """
  logits_BV = logits_BV.astype(jnp.float32)
  if temperature != 1.0:
    logits_BV = logits_BV / temperature
  return jax.nn.log_softmax(logits_BV, axis=-1)


def token_logprobs(logits_BSV: jax.Array, targets_BS: jax.Array, temperature: float = 1.0) -> jax.Array:
  """`log softmax(logits / temperature)[target]` at every slot, float32 (the sampler's log q form)."""
  logp_BSV = next_token_logq(logits_BSV, temperature)
  return jnp.take_along_axis(logp_BSV, targets_BS[..., None], axis=-1)[..., 0]


# --- Log-probs at a few ids without a second [B, T, V] tensor ------------------------------

# Where a logit is -inf (a masked vocabulary slot), p = 0 and log p = -inf; clamping log p
# to a finite floor keeps p * log p at 0 instead of 0 * -inf = NaN, without a select.
_LOGP_FLOOR = -1e30


def _lse_entropy(logits_NV: jax.Array, inv_temp: float):
  """logsumexp and entropy of softmax(logits * inv_temp), float32, as reductions over V.

  H = lse - sum_v p_v z_v = log s - sum_v e_v (z_v - m) / s with e = exp(z - m), s = sum e:
  only reductions of elementwise expressions of the logits.
  """
  # The max is taken on the logits in their own dtype (exact, and inv_temp > 0 commutes with
  # it), so no float32 copy of a bf16 [N, V] input is made just to feed this reduction.
  m_N1 = sg(jnp.max(logits_NV, axis=-1, keepdims=True).astype(jnp.float32) * inv_temp)
  z = logits_NV.astype(jnp.float32) * inv_temp
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
  picked = jnp.take_along_axis(logits_NV, ids_NK, axis=-1).astype(jnp.float32) * inv_temp
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


def chunked_logprobs(hidden_BTD: jax.Array, w_unembed_DV: jax.Array, ids_BTK: jax.Array,
                     temperature: float, chunk_size: int) -> tuple[jax.Array, jax.Array]:
  """gather_logprobs(hidden @ W, ids) computed over the sequence in chunks.

  Each chunk's logits [B, chunk, V] are made inside `lax.scan` under `jax.checkpoint`, so
  neither the forward nor the backward keeps more than one chunk of logits alive: the
  backward recomputes a chunk's logits from its hidden states. T is padded up to a whole
  number of chunks; the pad is sliced off. chunk_size = 0 (or >= T) is one chunk.
  """
  b, t, d = hidden_BTD.shape
  k = ids_BTK.shape[-1]

  def one_chunk(h_BcD, ids_BcK):
    logits = jnp.einsum("bcd,dv->bcv", h_BcD, w_unembed_DV,
                        preferred_element_type=jnp.float32)
    return gather_logprobs(logits, ids_BcK, temperature)

  if chunk_size <= 0 or chunk_size >= t:
    return one_chunk(hidden_BTD, ids_BTK)
  n = -(-t // chunk_size)
  pad = n * chunk_size - t
  h = jnp.pad(hidden_BTD, ((0, 0), (0, pad), (0, 0)))
  ids = jnp.pad(ids_BTK, ((0, 0), (0, pad), (0, 0)))
  h_NBcD = h.reshape(b, n, chunk_size, d).swapaxes(0, 1)
  ids_NBcK = ids.reshape(b, n, chunk_size, k).swapaxes(0, 1)
  body = jax.checkpoint(one_chunk, policy=jax.checkpoint_policies.nothing_saveable)

  def step(carry, xs):
    return carry, body(*xs)

  _, (lp_NBcK, ent_NBc) = jax.lax.scan(step, None, (h_NBcD, ids_NBcK))
  lp_BTK = lp_NBcK.swapaxes(0, 1).reshape(b, n * chunk_size, k)[:, :t]
  ent_BT = ent_NBc.swapaxes(0, 1).reshape(b, n * chunk_size)[:, :t]
  return lp_BTK, ent_BT
