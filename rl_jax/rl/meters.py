"""Meters of the sampler/trainer drift (per-token TV, score centering's share) and of the first-order approximation."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def exact_tv(logp_XV: jax.Array, logq_XV: jax.Array) -> jax.Array:
  """TV(q, p) = 1/2 sum_v |q_v - p_v| per position, from two full log-distributions [..., V]."""
  return 0.5 * jnp.sum(jnp.abs(jnp.exp(logq_XV) - jnp.exp(logp_XV)), axis=-1)


def topk_tv(head_logp_XK: jax.Array, head_logq_XK: jax.Array) -> jax.Array:
  """TV estimate from the sampler's recorded head H (its top-k ids) and the reconstructed tail.

  head_logq_XK: the sampler's log q at its top-k ids; head_logp_XK: the trainer's log p at
  the same ids. The tail is everything outside H, with masses 1 - sum_H q and 1 - sum_H p
  ([SC] Eq. 7 reconstructs the sampler's tail as rho * p, which has exactly that mass):

    TV_k = 1/2 (sum_{v in H} |q_v - p_v| + |tail_q - tail_p|).

  By the triangle inequality sum_{v not in H} |q_v - p_v| >= |tail_q - tail_p|, so TV_k is a
  LOWER bound of the exact TV, equal to it when q and p are proportional on the tail (the
  reconstruction's assumption) and when the head is the whole vocabulary (k = V: both tails
  are 0 up to rounding, so TV_k is then the exact TV).
  """
  q = jnp.exp(head_logq_XK.astype(jnp.float32))
  p = jnp.exp(head_logp_XK.astype(jnp.float32))
  # Rounding can make a head sum exceed 1 by an ulp: a tail mass is never negative.
  tail_q = jnp.maximum(1.0 - jnp.sum(q, axis=-1), 0.0)
  tail_p = jnp.maximum(1.0 - jnp.sum(p, axis=-1), 0.0)
  return 0.5 * (jnp.sum(jnp.abs(q - p), axis=-1) + jnp.abs(tail_q - tail_p))


def sc_logit_grad_sq_norms(*, weight_X: jax.Array, adv_X: jax.Array, c_XK: jax.Array,
                           head_p_XK: jax.Array, p_y_X: jax.Array,
                           y_in_head_XK: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Squared norms of one token's loss gradient in logit space: total and centering term.

  Per token the loss is ell = -w A log p_y + A sum_{v in H} c_v log p_v (w the rule's
  gradient weight, c the centering coefficients, both constants), and d log p_v / dz = e_v - p,
  so its gradient in the logits z is g = u - s p with the sparse u = A (c_H - w e_y) and
  s = A (sum_H c - w); the centering term alone is g_sc = A (c_H - (sum_H c) p). Then

    ||g||^2 = ||u||^2 - 2 s <u, p> + s^2 ||p||^2,   ||u||^2 = A^2 (sum c^2 - 2 w c_y + w^2),

  with c_y the coefficient at y when y is in H (else 0). Only the head and y are known, so
  ||p||^2 is taken over H and y: exact under full centering (H = the vocabulary), and under
  top-k it leaves out sum_{v not in H, v != y} p_v^2 <= tail_p * max tail p, small when the
  trainer's tail is spread out. The temperature scales both gradients alike and is left out.

  Args:
    weight_X, adv_X, p_y_X: w, A and p(y) per token; c_XK, head_p_XK: c_v and p_v on H;
    y_in_head_XK: one-hot (as float) of y's position in H (all zero if y is not in H).

  Returns:
    (||g||^2, ||g_sc||^2) per token.
  """
  a, w = adv_X, weight_X
  sum_c = jnp.sum(c_XK, axis=-1)
  c_y = jnp.sum(c_XK * y_in_head_XK, axis=-1)
  y_out = 1.0 - jnp.sum(y_in_head_XK, axis=-1)
  p_sq = jnp.sum(jnp.square(head_p_XK), axis=-1) + y_out * jnp.square(p_y_X)
  c_dot_p = jnp.sum(c_XK * head_p_XK, axis=-1)
  c_sq = jnp.sum(jnp.square(c_XK), axis=-1)
  u_sq = c_sq - 2.0 * w * c_y + jnp.square(w)
  u_dot_p = c_dot_p - w * p_y_X
  s = sum_c - w
  total = jnp.square(a) * (u_sq - 2.0 * s * u_dot_p + jnp.square(s) * p_sq)
  sc = jnp.square(a) * (c_sq - 2.0 * sum_c * c_dot_p + jnp.square(sum_c) * p_sq)
  # Cancellation can leave a tiny negative where the true value is 0.
  return jnp.maximum(total, 0.0), jnp.maximum(sc, 0.0)


def sc_share(total_sq: jax.Array, sc_sq: jax.Array) -> jax.Array:
  """Share of the update the centering term accounts for: ||G_sc|| / ||G|| over response tokens,
  from the masked sums over tokens of ||g_t||^2 (`total_sq`) and ||g_sc,t||^2 (`sc_sq`).

  G and G_sc stack the per-token logit-space gradients of all (masked-in) tokens, so this is
  sqrt(sum_t ||g_sc,t||^2 / sum_t ||g_t||^2): 0 without centering, about 1 when the centering
  term dominates (it can exceed 1 when it cancels part of the rule's gradient). No extra
  backward pass: it is computed from the head quantities the loss already has. Tokens count
  equally: that is the loss's own weighting under 'batch_tokens' and 'constant'
  aggregation; under 'seq_mean' it is the share in the unweighted token sum.
  """
  return jnp.sqrt(sc_sq / jnp.maximum(total_sq, 1e-30))


# --- First-order approximation ([MiniRL] Sec. 3) ---------------------------------------------

# log w_i is clipped here before exp so float32 cannot overflow (exp(88.7) does); the token
# rules clip their ratios at the same bound (methods.MAX_LOG_RATIO).
MAX_LOG_SEQ_RATIO = 80.0


def seq_normalizer(mask_BT: jax.Array, aggregation: str) -> jax.Array:
  """Z of the sequence-level objective: the constant the token loss's aggregation divides by.

  B * T under 'constant'; sum_i L_i under 'batch_tokens' and 'seq_mean' (for 'seq_mean' that
  is B times the mean length: the two objectives then have the same overall scale and differ
  only by the per-response 1 / L_i weights). Never below 1.
  """
  b, t = mask_BT.shape
  if aggregation == "constant":
    return jnp.asarray(float(b * t), jnp.float32)
  return jnp.maximum(jnp.sum(mask_BT.astype(jnp.float32)), 1.0)


def seq_objective_surrogate(logp_BT: jax.Array, logq_BT: jax.Array, adv_B: jax.Array,
                            mask_BT: jax.Array, z: jax.Array) -> tuple[jax.Array, jax.Array]:
  """A surrogate with the gradient of J_seq = (1/Z) sum_i A_i w_i, w_i = prod_t p(y_it) / q(y_it).

  In log space, w_i = exp(sum_t m_it (log p_it - log q_it)) over response tokens (m the mask).
  grad J_seq = (1/Z) sum_i A_i w_i sum_t m_it grad log p_it, which is the gradient of

    S = (1/Z) sum_i A_i sg(w_i) sum_t m_it log p_it,

  so S is differentiated instead of J_seq: same gradient, and no exp of a differentiated sum.
  Padding positions may hold anything (masked before any arithmetic). Returns (S, w_B).
  """
  on = mask_BT > 0
  m = on.astype(jnp.float32)
  logp_BT = jnp.where(on, logp_BT.astype(jnp.float32), 0.0)
  logq_BT = jnp.where(on, jax.lax.stop_gradient(logq_BT).astype(jnp.float32), 0.0)
  log_w_B = jnp.sum(m * jax.lax.stop_gradient(logp_BT - logq_BT), axis=1)
  w_B = jnp.exp(jnp.clip(log_w_B, -MAX_LOG_SEQ_RATIO, MAX_LOG_SEQ_RATIO))
  a_B = jax.lax.stop_gradient(adv_B).astype(jnp.float32)
  s = jnp.sum(a_B * w_B * jnp.sum(m * logp_BT, axis=1)) / z
  return s, w_B


def grad_alignment(g_tok, g_seq) -> dict[str, jax.Array]:
  """Cosine and norm ratio ||g_tok|| / ||g_seq|| of two gradient pytrees (all leaves flattened).

  Both are 0 when either gradient is exactly 0 (e.g. all advantages 0): no direction to compare.
  """
  leaves = lambda g: [x.astype(jnp.float32) for x in jax.tree.leaves(g)]
  a, b = leaves(g_tok), leaves(g_seq)
  if len(a) != len(b):
    raise ValueError(f"grad_alignment: gradients with {len(a)} and {len(b)} leaves")
  # Elementwise products summed in place, not `jnp.vdot`: vdot ravels each leaf, and a reshape
  # of an [E, D, F] leaf split over (expert, fsdp) to 1-D made GSPMD all-gather it (the 30B
  # plan's first-order meter: 297 GB of collectives, 258 GiB of temporaries per device).
  inner = lambda xs, ys: sum(jnp.sum(x * y) for x, y in zip(xs, ys))
  dot = inner(a, b)
  na = jnp.sqrt(inner(a, a))
  nb = jnp.sqrt(inner(b, b))
  ok = (na > 0) & (nb > 0)
  cos = jnp.where(ok, dot / jnp.where(ok, na * nb, 1.0), 0.0)
  ratio = jnp.where(ok, na / jnp.where(ok, nb, 1.0), 0.0)
  return {"cosine": cos, "norm_ratio": ratio}
