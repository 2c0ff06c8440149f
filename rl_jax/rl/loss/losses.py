"""The jitted RL loss of every method in docs/math.md, score centering, aggregation and diagnostics."""
from __future__ import annotations

import functools
import inspect
from typing import Optional

import jax
import jax.numpy as jnp

from rl_jax.logprobs import (chunked_logprobs, gather_logprobs,  # re-exported: rl_jax.rl.loss.losses.gather_logprobs
                             truncated_logprobs)
from rl_jax.rl import meters
from rl_jax.rl.loss import methods
from rl_jax.rl.loss.loss_config import LossConfig
from rl_jax.rl.loss.loss_diagnostics import diagnostic_stats, finalize_stats
from rl_jax.rl.loss.registry import METHOD_REGISTRY

sg = jax.lax.stop_gradient
Metrics = dict[str, jax.Array]


# --- Score centering ([SC], Eqs. 6-12; docs/math.md#top-k-score-centering) ---------------

def score_centering_coeffs(head_logp_BTK: jax.Array, topk_logq_BTK: jax.Array,
                           adv_BT: jax.Array, cfg: LossConfig) -> tuple[jax.Array, dict]:
  """Coefficients c_v of the centering term sum_{v in H} sg(c_v) log p_v ([SC], Eq. 12).

  w_v = f(p_v / q_v) with f the method's weight function (f = 1 for PG);
    full (k = V, no tail): c_v = q_v w_v                                    (Eq. 11 / 9)
    topk:                  c_v = q_v w_v - alpha p_v,  alpha = rho f(1 / rho),
                           rho = max(1 - sum_H q, eps) / max(1 - sum_H p, eps)  (Eq. 7, 10)
  The tail of the reconstructed sampler is rho * p, so by sum_v p_v s_v = 0 its expected
  score is -rho sum_H p_v s_v: the correction needs only the k head ids (Eq. 8).

  Returns:
    c_BTK (stop-gradient) and, for 'topk', per-token diagnostics (rho and sum_H p_v) keyed by
    their metric names sc_rho_mean, sc_trainer_head_mass_mean.
  """
  f = methods.weight_fn_for(cfg)
  head_logp_BTK = sg(head_logp_BTK)
  adv_BT1 = adv_BT[..., None]
  q = jnp.exp(topk_logq_BTK)
  p = jnp.exp(head_logp_BTK)
  r = jnp.exp(jnp.clip(head_logp_BTK - topk_logq_BTK, -methods.MAX_LOG_RATIO,
                       methods.MAX_LOG_RATIO))
  c = q * f(r, adv_BT1, cfg)
  stats = {}
  if cfg.score_centering == "topk":
    p_head_BT = jnp.sum(p, axis=-1)
    tail_q = jnp.maximum(1.0 - jnp.sum(q, axis=-1), cfg.sc_eps)
    tail_p = jnp.maximum(1.0 - p_head_BT, cfg.sc_eps)
    rho_BT = tail_q / tail_p
    alpha_BT = rho_BT * f(1.0 / rho_BT, adv_BT, cfg)
    c = c - alpha_BT[..., None] * p
    stats = {"sc_rho_mean": rho_BT, "sc_trainer_head_mass_mean": p_head_BT}
  return sg(c), stats


# --- Aggregation (docs/math.md#aggregation) --------------------------------------------------

def normalizer(mask_BT: jax.Array, aggregation: str) -> jax.Array:
  """The constant `aggregate` divides the summed losses by (see there), from the whole batch."""
  b, t = mask_BT.shape
  if aggregation == "batch_tokens":
    return jnp.maximum(jnp.sum(mask_BT.astype(jnp.float32)), 1.0)
  if aggregation == "constant":
    return jnp.asarray(float(b * t), jnp.float32)
  if aggregation == "seq_mean":
    return jnp.asarray(float(b), jnp.float32)
  raise ValueError(f"unknown aggregation {aggregation!r}")


def aggregate(ell_BT: jax.Array, mask_BT: jax.Array, aggregation: str, norm: jax.Array | None = None
              ) -> jax.Array:
  """Reduces masked per-token losses ell_it to the scalar loss.

  batch_tokens: sum_it ell / sum_i L_i                  ([SC]'s shared objective, Eq. 13)
  constant:     sum_it ell / (B * L_max)                (MiniRL; L_max = T, the padded
                response length of the arrays: pad to the configured maximum response
                length, not to the batch's longest response, or the scale drifts per batch)
  seq_mean:     (1/B) sum_i (1/L_i) sum_t ell_it        (length normalization, GRPO / CISPO)
  B counts every row, empty (all-padding) rows included. `norm` replaces the denominator
  (`normalizer` of these rows) by one computed over a larger batch: a micro-batch's share of
  the whole mini-batch's loss, so that the micro-batches' losses (and gradients) sum to it.
  """
  norm = normalizer(mask_BT, aggregation) if norm is None else norm
  if aggregation == "seq_mean":
    return jnp.sum(jnp.sum(ell_BT, axis=1) / jnp.maximum(jnp.sum(mask_BT, axis=1), 1.0)) / norm
  return jnp.sum(ell_BT) / norm


# --- Rejection and weight normalization (docs/math.md#rejection, #weight-normalization) ----
# Switches like aggregation: never inside a method, composable with every one of them.

def rejection_statistic(l_BT: jax.Array, mask_BT: jax.Array, estimator: str, reduce: str) -> jax.Array:
  """Per-sequence statistic of the rejection switch from the log-ratios l_t = log p - log q.

  Per token k1 = -l_t, k2 = l_t^2 / 2, k3 = exp(l_t) - 1 - l_t (exp capped as every ratio is),
  reduced over each row's response tokens by 'mean', 'sum' or 'max' (0 for an empty row).
  """
  if estimator == "k1":
    k_BT = -l_BT
  elif estimator == "k2":
    k_BT = 0.5 * l_BT * l_BT
  elif estimator == "k3":
    k_BT = jnp.expm1(jnp.minimum(l_BT, methods.MAX_LOG_RATIO)) - l_BT
  else:
    raise ValueError(f"unknown rejection estimator {estimator!r}")
  on = mask_BT > 0
  len_B = jnp.sum(on, axis=1)
  if reduce == "max":
    return jnp.where(len_B > 0, jnp.max(jnp.where(on, k_BT, -jnp.inf), axis=1), 0.0)
  sum_B = jnp.sum(jnp.where(on, k_BT, 0.0), axis=1)
  if reduce == "sum":
    return sum_B
  if reduce == "mean":
    return sum_B / jnp.maximum(len_B, 1)
  raise ValueError(f"unknown rejection reduction {reduce!r}")


def weight_normalizer(weight_BT: jax.Array, kept_BT: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(m, sum, n): the stop-gradient mean m = sum / n of the weights over the n kept tokens (m = 1
  when none is kept or their weights sum to 0, so the switch never divides by 0)."""
  n = jnp.sum(kept_BT).astype(jnp.float32)
  total = jnp.sum(jnp.where(kept_BT, sg(weight_BT), 0.0))
  m = total / jnp.maximum(n, 1.0)
  return jnp.where((n > 0) & (m > 0), m, 1.0), total, n


def _jit_loss(*static_argnames):
  """jax.jit with `cfg` static, after checking it is a LossConfig (a ConfigDict would fail
  with an opaque hashing error; convert it with config_utils.from_dict at the boundary)."""
  def deco(fn):
    jitted = jax.jit(fn, static_argnames=static_argnames)
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
      cfg = sig.bind_partial(*args, **kwargs).arguments.get("cfg")
      if not isinstance(cfg, LossConfig):
        raise TypeError("cfg must be a LossConfig (build it with config_utils.from_dict("
                        f"LossConfig, config.loss, prefix='loss')), got {type(cfg).__name__}")
      return jitted(*args, **kwargs)

    wrapper.jitted = jitted
    wrapper.lower = jitted.lower
    wrapper._cache_size = jitted._cache_size  # pylint: disable=protected-access
    return wrapper
  return deco


# --- The loss on per-token log-probs --------------------------------------------------------

def _check_bt(name, x, b, t):
  if x is not None and x.shape != (b, t):
    raise ValueError(f"{name} must have shape (B, T) = {(b, t)}, got {x.shape}")


def _check_common(mask_BT, adv_B, logq_BT, cfg, logp_old_BT, b, t):
  _check_bt("mask_BT", mask_BT, b, t)
  _check_bt("logq_BT", logq_BT, b, t)
  _check_bt("logp_old_BT", logp_old_BT, b, t)
  if adv_B.shape != (b,):
    raise ValueError(f"adv_B must have shape (B,) = {(b,)}, got {adv_B.shape}")
  if cfg.needs_logp_old and logp_old_BT is None:
    raise ValueError(
        f"loss.method={cfg.method!r} with is_ratio={cfg.is_ratio!r}, minirl_clip={cfg.minirl_clip}, "
        f"minirl_train_infer_is={cfg.minirl_train_infer_is} needs logp_old_BT (p_old from the "
        "forward pass at theta_old); it was not given")


def _loss_core(logp_BT, head_logp_BTK, entropy_BT, mask_BT, adv_B, logq_BT, cfg,
               logp_old_BT, topk_logq_BTK, y_in_head_BTK=None, norm=None, return_stats=False,
               trunc=None) -> tuple[jax.Array, Metrics]:
  """Rule + score centering + aggregation + diagnostics on [B, T(, K)] arrays.

  `norm`: the aggregation's denominator from the whole mini-batch (micro-batching, see
  `aggregate`); `return_stats`: the diagnostics' sufficient statistics
  (`loss_diagnostics.diagnostic_stats`, with 'sum/loss') instead of the metrics.

  head_logp_BTK / topk_logq_BTK: the trainer's and the sampler's log-probs at the sampler's
  whole recorded head (or None): the drift meter reads all of it, top-k score centering
  its first `cfg.topk` entries. y_in_head_BTK: one-hot of the sampled token in the head,
  for the `drift/sc_share` meter (without it y is taken to be outside the head).
  trunc: under `sampling_mask='kept_set'`, (in_y_BT, log_mass_BT): whether y lies in the trainer's
  rebuilt kept set and log p(K). A response token outside it (or outside theta_old's, where
  logp_old is -inf) is masked out of the objective and the diagnostics, and counted
  (`sampling_mask/outside_frac`); the aggregation's denominator still counts it, so the loss
  is the same function of the remaining tokens whatever the rebuild drops.
  """
  mask_BT = mask_BT.astype(jnp.float32)
  agg_mask_BT = mask_BT
  outside = None
  if trunc is not None:
    in_y_BT, log_mass_BT = trunc
    in_BT = in_y_BT if logp_old_BT is None else in_y_BT & jnp.isfinite(logp_old_BT)
    outside = (mask_BT > 0) & ~in_BT
    mask_BT = jnp.where(in_BT, mask_BT, 0.0)
  on = mask_BT > 0
  logp_BT = logp_BT.astype(jnp.float32)
  fill = sg(logp_BT)
  # Padding positions may hold anything the sampler wrote (0, -inf, NaN): replace them by
  # on-policy values so no rule sees a non-finite number, then zero their losses below.
  logq_BT = jnp.where(on, sg(logq_BT).astype(jnp.float32), fill)
  if logp_old_BT is not None:
    logp_old_BT = jnp.where(on, sg(logp_old_BT).astype(jnp.float32), fill)
  adv_BT = jnp.broadcast_to(sg(adv_B).astype(jnp.float32)[:, None], logp_BT.shape)
  x = methods.TokenInputs(logp_BT, logq_BT, logp_old_BT, adv_BT, mask_BT,
                          logp_old_BT if cfg.is_ratio == "p_old" else sg(logp_BT))
  # The rejection switch decides on whole rows before any method: the rule still runs on them
  # (rows are independent), then every one of their terms, the centering one included, is zeroed.
  rejected_BT = rej_stat_B = None
  if cfg.rejection != "none":
    rej_stat_B = rejection_statistic(methods.is_log_ratio(x), mask_BT, cfg.rejection,
                                     cfg.rejection_reduce)
    rejected_B = rej_stat_B > cfg.rejection_threshold
    rejected_BT = jnp.broadcast_to(rejected_B[:, None], mask_BT.shape) & on
  out = METHOD_REGISTRY[cfg.method].rule(x, cfg)
  if rejected_BT is not None:
    out = methods.drop_rows(out, rejected_B, count_as_dropped=False)
  kept_rows_BT = on if rejected_BT is None else on & ~rejected_BT
  weight_scale = weight_sums = None
  if cfg.weight_norm:
    kept_BT = kept_rows_BT & ~(out.dropped_BT | out.dual_clipped_BT | out.masked_BT)
    weight_scale, *weight_sums = weight_normalizer(out.weight_BT, kept_BT)
    out = out._replace(objective_BT=out.objective_BT / weight_scale,
                       weight_BT=out.weight_BT / weight_scale)
  objective_BT = out.objective_BT
  sc_stats = drift_tv_BT = sc_sq = None
  if head_logp_BTK is not None and topk_logq_BTK is not None:
    head_logp_BTK = head_logp_BTK.astype(jnp.float32)
    # Padding slots get the trainer's own values (so no NaN and zero drift there).
    topk_logq_BTK = jnp.where(on[..., None], sg(topk_logq_BTK).astype(jnp.float32),
                              sg(head_logp_BTK))
    drift_tv_BT = meters.topk_tv(sg(head_logp_BTK), topk_logq_BTK)
  if cfg.score_centering == "topk":
    # lax.top_k returns the head sorted by probability, so a prefix is the top-cfg.topk.
    head_logp_BTK = head_logp_BTK[..., :cfg.topk]
    topk_logq_BTK = topk_logq_BTK[..., :cfg.topk]
    if y_in_head_BTK is not None:
      y_in_head_BTK = y_in_head_BTK[..., :cfg.topk]
  if cfg.score_centering != "none":
    c_BTK, sc_stats = score_centering_coeffs(head_logp_BTK, topk_logq_BTK, adv_BT, cfg)
    # c_v is linear in the weight function f, so normalizing the weights divides it alike.
    if weight_scale is not None:
      c_BTK = c_BTK / weight_scale
    c_BTK = jnp.where(kept_rows_BT[..., None], c_BTK, 0.0)
    # J_t = [rule term] - A sum_H sg(c_v) log p_v  ([SC], Eq. 12; loss = -J).
    objective_BT = objective_BT - adv_BT * jnp.sum(c_BTK * head_logp_BTK, axis=-1)
    if y_in_head_BTK is None:
      y_in_head_BTK = jnp.zeros(c_BTK.shape, jnp.float32)
    sc_sq = meters.sc_logit_grad_sq_norms(
        weight_X=sg(out.weight_BT), adv_X=adv_BT, c_XK=c_BTK,
        head_p_XK=jnp.exp(sg(head_logp_BTK)), p_y_X=jnp.exp(sg(logp_BT)),
        y_in_head_XK=y_in_head_BTK.astype(jnp.float32))
  ell_BT = jnp.where(kept_rows_BT, -objective_BT, 0.0)
  loss = aggregate(ell_BT, agg_mask_BT, cfg.aggregation, norm)
  stats = diagnostic_stats(
      logp_BT=logp_BT, logq_BT=logq_BT, logp_old_BT=logp_old_BT, mask_BT=mask_BT,
      rule_out=out, entropy_BT=entropy_BT, topk_logq_BTK=topk_logq_BTK, sc_stats=sc_stats,
      drift_tv_BT=drift_tv_BT, sc_sq=sc_sq, rejected_BT=rejected_BT, rejection_stat_B=rej_stat_B,
      weight_norm_sums=weight_sums)
  if outside is not None:
    stats["sum/_outside"] = jnp.sum(outside.astype(jnp.float32))
    stats["sum/_kept_mass_p"] = jnp.sum(jnp.where(on, jnp.exp(sg(trunc[1])), 0.0))
  stats["sum/loss"] = sg(loss)
  return loss, (stats if return_stats else finalize_stats(stats))


@_jit_loss("cfg", "return_stats")
def rl_loss_from_logprobs(logp_BT: jax.Array, mask_BT: jax.Array, adv_B: jax.Array,
                          logq_BT: jax.Array, cfg: LossConfig, *,
                          logp_old_BT: Optional[jax.Array] = None,
                          head_logp_BTK: Optional[jax.Array] = None,
                          topk_logq_BTK: Optional[jax.Array] = None,
                          entropy_BT: Optional[jax.Array] = None,
                          y_in_head_BTK: Optional[jax.Array] = None,
                          norm: Optional[jax.Array] = None,
                          return_stats: bool = False) -> tuple[jax.Array, Metrics]:
  """The RL loss from the trainer's log-probs of the sampled tokens (no vocabulary axis).

  Same math as `rl_loss`. Score centering additionally needs `head_logp_BTK`, the trainer's
  log-probs at the sampler's top-k ids (aligned with `topk_logq_BTK`; top-k centering uses
  their first `cfg.topk` entries; for 'full', all V ids). Given both (with or without
  centering), they also feed the drift meter. `entropy_BT` only feeds the `entropy`
  diagnostic; `y_in_head_BTK` (one-hot of y in the head) only `drift/sc_share`.
  Under `cfg.sampling_mask='kept_set'` the inputs must already be the truncated policies' (log p~,
  log q~); with no vocabulary axis there is no kept set to rebuild, so masking the tokens outside
  it is the caller's (`rl_loss` does both).
  """
  b, t = logp_BT.shape
  _check_common(mask_BT, adv_B, logq_BT, cfg, logp_old_BT, b, t)
  if cfg.needs_topk and (head_logp_BTK is None or topk_logq_BTK is None):
    raise ValueError(f"loss.score_centering={cfg.score_centering!r} needs head_logp_BTK and "
                     "topk_logq_BTK")
  if head_logp_BTK is not None and topk_logq_BTK is not None:
    if head_logp_BTK.shape != topk_logq_BTK.shape:
      raise ValueError(f"head_logp_BTK {head_logp_BTK.shape} != topk_logq_BTK "
                       f"{topk_logq_BTK.shape}")
    if cfg.score_centering == "topk" and head_logp_BTK.shape[-1] < cfg.topk:
      raise ValueError(f"loss.topk={cfg.topk} but head_logp_BTK has only K = "
                       f"{head_logp_BTK.shape[-1]}")
  else:
    head_logp_BTK = None
  return _loss_core(logp_BT, head_logp_BTK, entropy_BT, mask_BT, adv_B, logq_BT, cfg,
                    logp_old_BT, topk_logq_BTK, y_in_head_BTK, norm, return_stats)


def _select_ids(targets_BT, topk_ids_BTK, topk_logq_BTK, cfg, v, b, t):
  """Ids to gather (sampled token first, then the sampler's whole recorded head, when given).

  Returns (ids_BTK1, the head's sampler logprobs, one-hot of y in the head or None). The
  head is gathered whenever it is given, score centering or not: the drift meter reads it
  (K more gathered ids next to the V-wide log-softmax); top-k centering cuts it to cfg.topk.
  """
  _check_bt("targets_BT", targets_BT, b, t)
  if topk_ids_BTK is None or topk_logq_BTK is None:
    if cfg.needs_topk:
      raise ValueError(f"loss.score_centering={cfg.score_centering!r} needs the sampler's "
                       "top-k ids and logprobs (topk_ids_BTK, topk_logq_BTK)")
    return targets_BT[..., None], topk_logq_BTK, None
  if topk_ids_BTK.shape != topk_logq_BTK.shape or topk_ids_BTK.shape[:2] != (b, t):
    raise ValueError(f"topk_ids_BTK {topk_ids_BTK.shape} and topk_logq_BTK "
                     f"{topk_logq_BTK.shape} must both be (B, T, K) with (B, T) = {(b, t)}")
  k_rec = topk_ids_BTK.shape[-1]
  if cfg.score_centering == "full":
    if k_rec != v:
      raise ValueError(f"loss.score_centering='full' needs the sampler's full distribution "
                       f"(top-k logged with k = V = {v}); got K = {k_rec}. Use 'topk'.")
  elif cfg.score_centering == "topk":
    if cfg.topk > v:
      raise ValueError(f"loss.topk={cfg.topk} is larger than the vocabulary V = {v}")
    if k_rec < cfg.topk:
      raise ValueError(f"loss.topk={cfg.topk} but the sampler recorded only K = {k_rec}")
  y_in_head_BTK = (topk_ids_BTK == targets_BT[..., None]).astype(jnp.float32)
  ids_BTK1 = jnp.concatenate([targets_BT[..., None], topk_ids_BTK], axis=-1)
  return ids_BTK1, topk_logq_BTK, y_in_head_BTK


def kept_set_args(cfg, trunc_thresh_BT, trunc_covered_BT, topk_ids_BTK, topk_logq_BTK, b, t):
  """`truncated_logprobs`' per-position arguments under `sampling_mask='kept_set'`, else None.

  The head is the sampler's recorded top-k, an entry kept iff its (truncated) log q is finite
  (`TrainBatch.from_rollout` writes -1e30 outside the kept set); without it the kept set is
  rebuilt by the threshold alone.
  """
  if not cfg.kept_set_mask:
    return None
  if trunc_thresh_BT is None:
    raise ValueError("loss.sampling_mask='kept_set' needs trunc_thresh_BT (the sampler's kept-set threshold "
                     "per token, TrainBatch.from_rollout(truncated=True))")
  _check_bt("trunc_thresh_BT", trunc_thresh_BT, b, t)
  if topk_ids_BTK is None:
    return sg(trunc_thresh_BT), None, None, None
  _check_bt("trunc_covered_BT", trunc_covered_BT, b, t)
  return sg(trunc_thresh_BT), topk_ids_BTK, sg(topk_logq_BTK) > -1e29, trunc_covered_BT


def _split_outputs(outs, y_in_BTK):
  """(log p of y, head log-probs or None, entropy, trunc for `_loss_core`) from the gathered
  outputs (`gather_logprobs`' two or `truncated_logprobs`' four); a head id outside the
  rebuilt kept set has p~ = 0 (-1e30: no centering weight, no gradient)."""
  lp_BTK1, ent_BT = outs[:2]
  head = lp_BTK1[..., 1:] if y_in_BTK is not None else None
  if len(outs) == 2:
    return lp_BTK1[..., 0], head, ent_BT, None
  in_BTK1, log_mass_BT = outs[2:]
  if head is not None:
    head = jnp.where(in_BTK1[..., 1:], head, -1e30)
  return lp_BTK1[..., 0], head, ent_BT, (in_BTK1[..., 0], log_mass_BT)


@_jit_loss("cfg", "return_stats")
def rl_loss(logits_BTV: jax.Array, targets_BT: jax.Array, mask_BT: jax.Array, adv_B: jax.Array,
            logq_BT: jax.Array, cfg: LossConfig, *, logp_old_BT: Optional[jax.Array] = None,
            topk_ids_BTK: Optional[jax.Array] = None,
            topk_logq_BTK: Optional[jax.Array] = None, norm: Optional[jax.Array] = None,
            return_stats: bool = False, trunc_thresh_BT: Optional[jax.Array] = None,
            trunc_covered_BT: Optional[jax.Array] = None) -> tuple[jax.Array, Metrics]:
  """RL loss (minus objective) and diagnostics for `cfg.method` (docs/math.md#correction-methods).

  Per token, with A_i the response's advantage and r_t = p(y_t)/q(y_t):
    ell_t = -J_t(rule)                                          ([SC] Table 1; [MiniRL] Eq. 7)
            + A * sum_{v in H} sg(c_v) log p_v   if score centering ([SC], Eq. 6 / 11 / 12)
  then masked and reduced by `cfg.aggregation` (see `aggregate`).

  Args:
    logits_BTV: trainer logits, un-temperature-scaled; [:, t] predicts targets_BT[:, t].
      Log-probs also work (log-softmax is idempotent) if they were made at temperature 1.
    targets_BT: sampled token ids y_t.
    mask_BT: 1 on response tokens, 0 on prompt / padding.
    adv_B: advantage of each response (see advantages.compute_advantages).
    logq_BT: sampler log q(y_t), the temperature-scaled full-vocabulary log-softmax.
    cfg: LossConfig (static; one compile per config and shape).
    logp_old_BT: trainer log p_old(y_t) at theta_old; required by MiniRL's mask and its
      `- train_infer_is` ablation, by decoupled_ppo and by `is_ratio='p_old'`
      (`cfg.needs_logp_old`); else used only for the KL / prob-diff diagnostics.
    topk_ids_BTK, topk_logq_BTK: sampler top-k ids and logprobs (sorted descending);
      required by score centering (K = V for 'full'); also give `head_mass_*` and, with or
      without centering, the drift meter `drift/tv_mean`, `drift/tv_max` (meters.topk_tv:
      exact when K = V, else a lower bound).
    norm: the aggregation's denominator over the whole mini-batch when these rows are one
      micro-batch of it (`normalizer`); default: these rows' own.
    return_stats: return the diagnostics' sufficient statistics instead of the metrics
      (micro-batches combine them with `loss_diagnostics.combine_stats`).
    trunc_thresh_BT, trunc_covered_BT: the sampler's kept sets under
      `cfg.sampling_mask='kept_set'` (`TrainBatch`; docs/math.md#truncated-sampling): p is then
      truncated to the rebuilt set and renormalized; logq_BT / topk_logq_BTK must be the
      sampler's truncated ones (`TrainBatch.from_rollout(truncated=True)`).

  Returns:
    (loss scalar, metrics dict of stop-gradient float32 scalars, see loss_diagnostics).
  """
  b, t, v = logits_BTV.shape
  _check_common(mask_BT, adv_B, logq_BT, cfg, logp_old_BT, b, t)
  ids_BTK1, topk_logq_BTK, y_in_BTK = _select_ids(targets_BT, topk_ids_BTK, topk_logq_BTK, cfg,
                                                 v, b, t)
  trunc = kept_set_args(cfg, trunc_thresh_BT, trunc_covered_BT, topk_ids_BTK, topk_logq_BTK, b, t)
  outs = (gather_logprobs(logits_BTV, ids_BTK1, cfg.temperature) if trunc is None else
          truncated_logprobs(logits_BTV, ids_BTK1, cfg.temperature, *trunc))
  lp_BT, head, ent_BT, in_set = _split_outputs(outs, y_in_BTK)
  return _loss_core(lp_BT, head, ent_BT, mask_BT, adv_B, logq_BT, cfg,
                    logp_old_BT, topk_logq_BTK, y_in_BTK, norm, return_stats, in_set)


@_jit_loss("cfg", "chunk_size", "return_stats")
def rl_loss_from_hidden(hidden_BTD: jax.Array, w_unembed_DV: jax.Array, targets_BT: jax.Array,
                        mask_BT: jax.Array, adv_B: jax.Array, logq_BT: jax.Array,
                        cfg: LossConfig, *, logp_old_BT: Optional[jax.Array] = None,
                        topk_ids_BTK: Optional[jax.Array] = None,
                        topk_logq_BTK: Optional[jax.Array] = None,
                        chunk_size: Optional[int] = None, norm: Optional[jax.Array] = None,
                        return_stats: bool = False, trunc_thresh_BT: Optional[jax.Array] = None,
                        trunc_covered_BT: Optional[jax.Array] = None) -> tuple[jax.Array, Metrics]:
  """`rl_loss` with logits = hidden_BTD @ w_unembed_DV made chunk by chunk over T.

  For long responses: only one [B, chunk, V] float32 logits block is live at a time (see
  `chunked_logprobs`). The per-token rule, score centering and aggregation then run on the
  gathered [B, T, K] log-probs, so the result equals the unchunked one (sequence-level
  statistics such as GSPO's mean see the whole response). `chunk_size` defaults to
  `cfg.chunk_size` (0 = unchunked).
  """
  b, t, _ = hidden_BTD.shape
  v = w_unembed_DV.shape[-1]
  _check_common(mask_BT, adv_B, logq_BT, cfg, logp_old_BT, b, t)
  ids_BTK1, topk_logq_BTK, y_in_BTK = _select_ids(targets_BT, topk_ids_BTK, topk_logq_BTK, cfg,
                                                 v, b, t)
  chunk = cfg.chunk_size if chunk_size is None else chunk_size
  trunc = kept_set_args(cfg, trunc_thresh_BT, trunc_covered_BT, topk_ids_BTK, topk_logq_BTK, b, t)
  outs = chunked_logprobs(hidden_BTD, w_unembed_DV, ids_BTK1, cfg.temperature, chunk, trunc)
  lp_BT, head, ent_BT, in_set = _split_outputs(outs, y_in_BTK)
  return _loss_core(lp_BT, head, ent_BT, mask_BT, adv_B, logq_BT, cfg,
                    logp_old_BT, topk_logq_BTK, y_in_BTK, norm, return_stats, in_set)
