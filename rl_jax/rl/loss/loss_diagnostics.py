"""Diagnostics returned with the RL loss (docs/metrics.md), masked by the response mask, stop-gradient.

Computed in two steps so that micro-batches combine exactly (`rl.update_microbatch`):
`diagnostic_stats` returns additive sufficient statistics, keyed 'sum/', 'max/', 'min/' or 'lse/'
(log-sum-exp) by how two micro-batches' values combine (`combine_stats`), and
`finalize_stats` turns them into the metrics. `loss_diagnostics` is the two in one.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from rl_jax.rl import meters
from rl_jax.rl.loss.methods import MAX_LOG_RATIO, RuleOutput

sg = jax.lax.stop_gradient


def diagnostic_stats(*, logp_BT: jax.Array, logq_BT: jax.Array, logp_old_BT: Optional[jax.Array],
                     mask_BT: jax.Array, rule_out: RuleOutput,
                     entropy_BT: Optional[jax.Array] = None,
                     topk_logq_BTK: Optional[jax.Array] = None,
                     sc_stats: Optional[dict] = None,
                     drift_tv_BT: Optional[jax.Array] = None,
                     sc_sq: Optional[tuple[jax.Array, jax.Array]] = None,
                     rejected_BT: Optional[jax.Array] = None,
                     rejection_stat_B: Optional[jax.Array] = None,
                     weight_norm_sums: Optional[tuple[jax.Array, jax.Array]] = None
                     ) -> dict[str, jax.Array]:
  """Sufficient statistics of the diagnostics over response tokens (padding excluded).

  `finalize_stats` of them gives the metrics (keys fixed for a given set of inputs, so logs
  stack across steps):
    num_tokens, response_len_mean: sum_i L_i and mean_i L_i.
    entropy: mean token entropy of p_theta (when the vocabulary axis was seen).
    kl_k1_vs_current, kl_k3_vs_current: D_KL(q || p_theta) estimators mean(log q - log p_theta)
      and mean(r - 1 - log r), r = p_theta / q: the sampler against the CURRENT trainer, which
      grows over the N mini-batches with staleness. (The sampler against theta_old is the
      trainer's p_old forward's `mismatch/*`; docs/metrics.md.)
    is_ratio_mean / _max / _min: r_t = p_theta / q on sampled tokens.
    is_ess: normalized effective sample size (sum r)^2 / (n sum r^2) of those ratios, in (0, 1].
    staleness_ratio_mean / _max: s_t = p_theta / p_old (only when p_old is given).
    weight_mean, weight_max: the method's effective gradient weight w_t (after the rejection
      switch and weight normalization).
    weight_ess: normalized effective sample size (sum w)^2 / (n sum w^2) of those weights over
      every response token (a dropped or rejected token counts with weight 0), in [0, 1].
    frac_clipped / frac_dropped / frac_dual_clipped / frac_masked: token fractions where
      the weight was capped / the band (or a sequence method's drop) zeroed the gradient / PPO's
      dual clip bound / MiniRL's M_t = 0.
    seq_frac_dropped: fraction of (non-empty) responses every token of which the method dropped
      (seq_mis, geo_mask, opsm drop whole responses; a token band can too).
    frac_rejected, seq_frac_rejected, rejection_stat_mean, rejection_stat_max: with the rejection
      switch on, the token and response fractions it rejected and its per-response statistic
      (mean and max over non-empty responses).
    weight_norm_divisor: with weight normalization on, the mean weight the weights were divided by.
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
    sampling_mask/outside_frac, sampling_mask/kept_mass_p: under `loss.sampling_mask='kept_set'`
      (the loss adds their statistics; `mask_BT` is then the tokens inside the kept sets, so
      the means above are over those): the fraction of response tokens outside the trainer's
      rebuilt kept set (masked), and the trainer's mass p_theta(K) on the kept set.
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
  if logp_old_BT is not None:
    s = jnp.exp(jnp.clip(logp_BT - sg(logp_old_BT), -MAX_LOG_RATIO, MAX_LOG_RATIO))
    means["staleness_ratio_mean"] = maxes["staleness_ratio_max"] = s

  w = sg(rule_out.weight_BT)
  means["weight_mean"] = maxes["weight_max"] = w
  means["frac_clipped"] = rule_out.clipped_BT
  means["frac_dropped"] = rule_out.dropped_BT
  means["frac_dual_clipped"] = rule_out.dual_clipped_BT
  means["frac_masked"] = rule_out.masked_BT
  if rejected_BT is not None:
    means["frac_rejected"] = rejected_BT
  if topk_logq_BTK is not None:
    head_BT = jnp.sum(jnp.exp(sg(topk_logq_BTK).astype(jnp.float32)), axis=-1)
    means["head_mass_mean"] = mins["head_mass_min"] = head_BT
  for k, v in (sc_stats or {}).items():
    means[k] = sg(v)
  if drift_tv_BT is not None:
    means["drift/tv_mean"] = maxes["drift/tv_max"] = sg(drift_tv_BT)

  diff = jnp.exp(logq_BT) * jnp.abs(jnp.expm1(logp_BT - logq_BT))  # |p - q|, 0 where they are equal
  means["prob_diff_vs_current_mean"] = maxes["prob_diff_vs_current_max"] = diff

  def reduce(d, op, fill):
    if not d:
      return {}
    x = jnp.stack([jnp.broadcast_to(v, mask_BT.shape).astype(jnp.float32) for v in d.values()])
    red = op(jnp.where(on[None], x, fill), axis=(1, 2))
    return dict(zip(d, red))

  st = {"sum/_tokens": n, "sum/_rows": jnp.asarray(mask_BT.shape[0], jnp.float32)}
  st.update({f"sum/{k}": v for k, v in reduce(means, jnp.sum, 0.0).items()})
  st.update({f"max/{k}": v for k, v in reduce(maxes, jnp.max, -jnp.inf).items()})
  st.update({f"min/{k}": v for k, v in reduce(mins, jnp.min, jnp.inf).items()})
  if sc_sq is not None:
    m = mask_BT.astype(jnp.float32)
    st["sum/_sc_sq"] = jnp.sum(m * sg(sc_sq[1]))
    st["sum/_total_sq"] = jnp.sum(m * sg(sc_sq[0]))
  # ESS = (sum r)^2 / (n sum r^2) from log-sum-exps: scale-free, and r up to e^80 cannot overflow.
  neg = jnp.float32(-jnp.inf)
  st["lse/_log_r"] = jax.nn.logsumexp(jnp.where(on, log_r, neg))
  st["lse/_2log_r"] = jax.nn.logsumexp(jnp.where(on, 2.0 * log_r, neg))
  # The weights' ESS the same way (log 0 = -inf: a dropped token adds n but no mass).
  log_w = jnp.where(on & (w > 0), jnp.log(jnp.where(w > 0, w, 1.0)), neg)
  st["lse/_log_w"] = jax.nn.logsumexp(log_w)
  st["lse/_2log_w"] = jax.nn.logsumexp(2.0 * log_w)
  per_seq_B = jnp.sum(jnp.where(on, log_r, 0.0), axis=1) / jnp.maximum(len_B, 1.0)
  seq_B = len_B > 0
  st["sum/_seqs"] = jnp.sum(seq_B).astype(jnp.float32)
  st["sum/_log_ppl"] = jnp.sum(jnp.where(seq_B, per_seq_B, 0.0))
  all_dropped_B = seq_B & (jnp.sum(on & rule_out.dropped_BT, axis=1) == len_B)
  st["sum/_seq_dropped"] = jnp.sum(all_dropped_B).astype(jnp.float32)
  if rejected_BT is not None:
    st["sum/_seq_rejected"] = jnp.sum(seq_B & jnp.any(rejected_BT & on, axis=1)).astype(jnp.float32)
    st["sum/_rejection_stat"] = jnp.sum(jnp.where(seq_B, rejection_stat_B, 0.0))
    st["max/rejection_stat_max"] = jnp.max(jnp.where(seq_B, rejection_stat_B, -jnp.inf))
  if weight_norm_sums is not None:
    st["sum/_wn_weight"], st["sum/_wn_tokens"] = weight_norm_sums
  return {k: sg(jnp.asarray(v, jnp.float32)) for k, v in st.items()}


_COMBINE = {"sum": jnp.add, "max": jnp.maximum, "min": jnp.minimum, "lse": jnp.logaddexp}


def combine_stats(a: dict[str, jax.Array], b: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """The statistics of two disjoint sets of rows from each set's (`diagnostic_stats` keys)."""
  if a.keys() != b.keys():
    raise ValueError(f"combine_stats: different keys {sorted(a.keys() ^ b.keys())}")
  return {k: _COMBINE[k.split("/", 1)[0]](a[k], b[k]) for k in a}


_REDUCE = {"sum": jnp.sum, "max": jnp.max, "min": jnp.min, "lse": jax.nn.logsumexp}


def reduce_stacked(st: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """`combine_stats` over a leading axis (one entry per micro-batch, e.g. a scan's outputs)."""
  return {k: _REDUCE[k.split("/", 1)[0]](v, axis=0) for k, v in st.items()}


def finalize_stats(st: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """Metrics from (combined) `diagnostic_stats`: means over tokens, maxes / mins (0 without a
  token), ESS, the log-ppl difference over responses, sc_share; other 'sum/' keys without a
  leading '_' (e.g. 'sum/loss') are passed through as their sum."""
  n = st["sum/_tokens"]
  m = {"num_tokens": n, "response_len_mean": n / jnp.maximum(st["sum/_rows"], 1.0)}
  for k, v in st.items():
    kind, name = k.split("/", 1)
    if name.startswith("_"):
      continue
    if kind == "sum":
      m[name] = v if name in PASS_THROUGH else v / jnp.maximum(n, 1.0)
    elif kind in ("max", "min"):
      m[name] = jnp.where(n > 0, v, 0.0)
  if "sum/_sc_sq" in st:
    m["drift/sc_share"] = meters.sc_share(st["sum/_total_sq"], st["sum/_sc_sq"])
  if "lse/_log_r" in st:
    ess = jnp.exp(2.0 * st["lse/_log_r"] - st["lse/_2log_r"]) / jnp.maximum(n, 1.0)
    m["is_ess"] = jnp.where(n > 0, ess, 0.0)
  if "sum/_outside" in st:  # loss.sampling_mask='kept_set': n counts the tokens in the kept sets
    m["sampling_mask/outside_frac"] = st["sum/_outside"] / jnp.maximum(n + st["sum/_outside"], 1.0)
    m["sampling_mask/kept_mass_p"] = st["sum/_kept_mass_p"] / jnp.maximum(n, 1.0)
  if "lse/_log_w" in st:
    ess_w = jnp.exp(2.0 * st["lse/_log_w"] - st["lse/_2log_w"]) / jnp.maximum(n, 1.0)
    m["weight_ess"] = jnp.where((n > 0) & jnp.isfinite(st["lse/_log_w"]), ess_w, 0.0)
  seqs = jnp.maximum(st.get("sum/_seqs", 0.0), 1.0)
  if "sum/_log_ppl" in st:
    m["log_ppl_diff_vs_current"] = st["sum/_log_ppl"] / seqs
  if "sum/_seq_dropped" in st:
    m["seq_frac_dropped"] = st["sum/_seq_dropped"] / seqs
  if "sum/_seq_rejected" in st:
    m["seq_frac_rejected"] = st["sum/_seq_rejected"] / seqs
    m["rejection_stat_mean"] = st["sum/_rejection_stat"] / seqs
  if "sum/_wn_weight" in st:
    wn = st["sum/_wn_weight"] / jnp.maximum(st["sum/_wn_tokens"], 1.0)
    m["weight_norm_divisor"] = jnp.where((st["sum/_wn_tokens"] > 0) & (wn > 0), wn, 1.0)
  return {k: sg(jnp.asarray(v, jnp.float32)) for k, v in m.items()}


# 'sum/' statistics that are totals, not per-token sums to average (the loss itself).
PASS_THROUGH = frozenset({"loss"})


def loss_diagnostics(**kwargs) -> dict[str, jax.Array]:
  """`finalize_stats(diagnostic_stats(**kwargs))`: the metrics of one batch (keys in diagnostic_stats)."""
  return finalize_stats(diagnostic_stats(**kwargs))
