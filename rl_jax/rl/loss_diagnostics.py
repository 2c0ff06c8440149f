"""Diagnostics returned with the RL loss (docs/metrics.md), masked by the response mask, stop-gradient."""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from rl_jax.rl import meters
from rl_jax.rl.methods import MAX_LOG_RATIO, RuleOutput

sg = jax.lax.stop_gradient


def loss_diagnostics(*, logp_BT: jax.Array, logq_BT: jax.Array, logp_old_BT: Optional[jax.Array],
                     mask_BT: jax.Array, rule_out: RuleOutput,
                     entropy_BT: Optional[jax.Array] = None,
                     topk_logq_BTK: Optional[jax.Array] = None,
                     sc_stats: Optional[dict] = None,
                     drift_tv_BT: Optional[jax.Array] = None,
                     sc_sq: Optional[tuple[jax.Array, jax.Array]] = None) -> dict[str, jax.Array]:
  """Scalar diagnostics over response tokens (padding excluded), all stop-gradient.

  Keys (fixed for a given set of inputs, so logs stack across steps):
    num_tokens, response_len_mean: sum_i L_i and mean_i L_i.
    entropy: mean token entropy of p_theta (when the vocabulary axis was seen).
    kl_k1_vs_current, kl_k3_vs_current: D_KL(q || p_theta) estimators mean(log q - log p_theta)
      and mean(r - 1 - log r), r = p_theta / q: the sampler against the CURRENT trainer, which
      grows over the N mini-batches with staleness. (The sampler against theta_old is the
      trainer's p_old forward's `mismatch/*`; docs/metrics.md.)
    is_ratio_mean / _max / _min: r_t = p_theta / q on sampled tokens.
    is_ess: normalized effective sample size (sum r)^2 / (n sum r^2) of those ratios, in (0, 1].
    staleness_ratio_mean / _max: s_t = p_theta / p_old (only when p_old is given).
    weight_mean, weight_max: the method's effective gradient weight w_t.
    frac_clipped / frac_dropped / frac_dual_clipped / frac_masked: token fractions where
      the weight was capped / the band dropped the gradient / PPO's dual clip bound /
      MiniRL's M_t = 0.
    head_mass_mean, head_mass_min: sampler head mass sum_H q_v (when top-k is given).
    sc_rho_mean, sc_trainer_head_mass_mean: rho and sum_H p_v of top-k score centering.
    prob_diff_vs_current_mean / _max: |p_theta(y_t) - q(y_t)|.
    log_ppl_diff_vs_current: mean over responses of log ppl_q - log ppl_p_theta
      = mean_i (1/L_i) sum_t (log p_theta - log q).
    drift/tv_mean, drift/tv_max: per-token total variation between the sampler's q and the
      current trainer's p (meters.topk_tv; exact when the head is the whole vocabulary,
      else a lower bound), when the sampler's top-k was given.
    drift/sc_share: ||G_sc|| / ||G|| of the logit-space gradients, score centering's share
      of the update (meters.sc_share), when score centering is on.
  """
  logp_BT, logq_BT, mask_BT = sg(logp_BT), sg(logq_BT), sg(mask_BT)
  on = mask_BT > 0
  len_B = jnp.sum(mask_BT, axis=1)
  n = jnp.sum(len_B)
  # Per-token quantities are stacked and reduced together: one masked sum, one masked max
  # and one masked min instead of a reduction per metric (much smaller programs to compile).
  means, maxes, mins = {}, {}, {}
  if entropy_BT is not None:
    means["entropy"] = sg(entropy_BT)

  log_r = jnp.clip(logp_BT - logq_BT, -MAX_LOG_RATIO, MAX_LOG_RATIO)
  r = jnp.exp(log_r)
  means["kl_k1_vs_current"] = -log_r
  means["kl_k3_vs_current"] = r - 1.0 - log_r
  means["is_ratio_mean"] = maxes["is_ratio_max"] = mins["is_ratio_min"] = r
  maxes["_log_r_max"] = log_r
  if logp_old_BT is not None:
    s = jnp.exp(jnp.clip(logp_BT - sg(logp_old_BT), -MAX_LOG_RATIO, MAX_LOG_RATIO))
    means["staleness_ratio_mean"] = maxes["staleness_ratio_max"] = s

  w = sg(rule_out.weight_BT)
  means["weight_mean"] = maxes["weight_max"] = w
  means["frac_clipped"] = rule_out.clipped_BT
  means["frac_dropped"] = rule_out.dropped_BT
  means["frac_dual_clipped"] = rule_out.dual_clipped_BT
  means["frac_masked"] = rule_out.masked_BT
  if topk_logq_BTK is not None:
    head_BT = jnp.sum(jnp.exp(sg(topk_logq_BTK).astype(jnp.float32)), axis=-1)
    means["head_mass_mean"] = mins["head_mass_min"] = head_BT
  for k, v in (sc_stats or {}).items():
    means[k] = sg(v)
  if drift_tv_BT is not None:
    means["drift/tv_mean"] = maxes["drift/tv_max"] = sg(drift_tv_BT)

  diff = jnp.abs(jnp.exp(logp_BT) - jnp.exp(logq_BT))
  means["prob_diff_vs_current_mean"] = maxes["prob_diff_vs_current_max"] = diff

  def reduce(d, op, fill):
    if not d:
      return {}
    x = jnp.stack([jnp.broadcast_to(v, mask_BT.shape).astype(jnp.float32) for v in d.values()])
    red = op(jnp.where(on[None], x, fill), axis=(1, 2))
    return dict(zip(d, red))

  m = {"num_tokens": n, "response_len_mean": jnp.mean(len_B)}
  m.update({k: v / jnp.maximum(n, 1.0) for k, v in reduce(means, jnp.sum, 0.0).items()})
  m.update({k: jnp.where(n > 0, v, 0.0) for k, v in reduce(maxes, jnp.max, -jnp.inf).items()})
  m.update({k: jnp.where(n > 0, v, 0.0) for k, v in reduce(mins, jnp.min, jnp.inf).items()})

  # Normalized ESS of the ratios; scaled by the largest ratio first so sum r^2 cannot
  # overflow (ESS is scale-free).
  if sc_sq is not None:
    m["drift/sc_share"] = meters.sc_share(sg(sc_sq[0]), sg(sc_sq[1]), mask_BT)
  r_scaled = jnp.where(on, jnp.exp(log_r - m.pop("_log_r_max")), 0.0)
  m["is_ess"] = jnp.square(jnp.sum(r_scaled)) / jnp.maximum(
      n * jnp.sum(jnp.square(r_scaled)), 1e-30)
  per_seq_B = jnp.sum(jnp.where(on, log_r, 0.0), axis=1) / jnp.maximum(len_B, 1.0)
  n_seq = jnp.sum(len_B > 0)
  m["log_ppl_diff_vs_current"] = jnp.sum(jnp.where(len_B > 0, per_seq_B, 0.0)) / jnp.maximum(n_seq, 1)
  return {k: sg(jnp.asarray(v, jnp.float32)) for k, v in m.items()}
