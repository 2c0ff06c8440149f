"""The correction rules of docs/math.md#correction-methods: per-token weights, clips, drops and masks, and their specs."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from rl_jax.config_utils import require
from rl_jax.rl.loss.registry import METHOD_REGISTRY, MethodSpec, Param, method

if TYPE_CHECKING:  # loss_config imports this module (for BUILTIN_METHODS) before LossConfig exists
  from rl_jax.rl.loss.loss_config import LossConfig

sg = jax.lax.stop_gradient

# Log-ratios are capped before exp so a garbage or -inf logprob can never produce inf (and
# then 0 * inf = NaN in a masked gradient). e^80 ~ 5e34 is finite in float32 and far past
# every threshold of every rule, so no rule changes its decision because of the cap.
MAX_LOG_RATIO = 80.0


class TokenInputs(NamedTuple):
  """What every rule reads, all [B, T] float32 with padding already made finite.

  logp_BT: trainer log p_theta(y_t); the only input that carries gradient.
  logq_BT: sampler log q(y_t) (constant).
  logp_old_BT: trainer log p_old(y_t) at theta_old (constant), or None.
  adv_BT: advantage A_i broadcast over the tokens of response i (constant).
  mask_BT: response mask, 1.0 on response tokens.
  logp_is_BT: the log p every IS weight and mask reads (constant): p_old's under
    `loss.is_ratio='p_old'` (docs/math.md#the-decoupled-ratio); None means sg(logp_BT).
  """
  logp_BT: jax.Array
  logq_BT: jax.Array
  logp_old_BT: Optional[jax.Array]
  adv_BT: jax.Array
  mask_BT: jax.Array
  logp_is_BT: Optional[jax.Array] = None


class RuleOutput(NamedTuple):
  """A rule's per-token objective and its diagnostics (nothing masked or aggregated yet).

  objective_BT: the token's surrogate objective J_t (loss = -J); its gradient is
    weight_BT * A * grad log p(y_t).
  weight_BT: that gradient weight w_t (stop-gradient); 1 for plain PG, 0 for dropped tokens.
  clipped_BT: the weight was capped (the token still carries gradient).
  dropped_BT: the token's gradient was zeroed by the rule's ratio / TV band.
  dual_clipped_BT: PPO-family dual clip (A < 0, ratio > dual_clip) zeroed the gradient.
  masked_BT: MiniRL's M_t = 0.
  """
  objective_BT: jax.Array
  weight_BT: jax.Array
  clipped_BT: jax.Array
  dropped_BT: jax.Array
  dual_clipped_BT: jax.Array
  masked_BT: jax.Array


def safe_ratio(log_ratio: jax.Array) -> jax.Array:
  """exp of a log-ratio, capped at MAX_LOG_RATIO (gradient passes below the cap)."""
  return jnp.exp(jnp.minimum(log_ratio, MAX_LOG_RATIO))


def _false(x: jax.Array) -> jax.Array:
  return jnp.zeros(x.shape, bool)


def is_log_ratio(x: TokenInputs) -> jax.Array:
  """l_t = log p(y_t) - log q(y_t), stop-gradient, with p = p_old under `loss.is_ratio='p_old'`.

  What every IS weight, sequence statistic and the rejection switch read; padding is 0 (the
  loss fills padded log q and log p_old with log p).
  """
  logp_BT = sg(x.logp_BT) if x.logp_is_BT is None else x.logp_is_BT
  return logp_BT - x.logq_BT


def _is_ratio(x: TokenInputs) -> jax.Array:
  """The IS ratio exp(l_t) every stop-gradient weight reads (capped, no gradient)."""
  return safe_ratio(is_log_ratio(x))


def _log(v: float) -> float:
  """log of a threshold, -inf at 0 (a lower bound of 0 keeps every ratio)."""
  return math.log(v) if v > 0 else -math.inf


def drop_rows(out: RuleOutput, drop_B: jax.Array, *, count_as_dropped: bool) -> RuleOutput:
  """`out` with every token of the rows `drop_B` carrying no objective and no gradient.

  Their objective is exactly 0 (not a constant branch), so a dropped row adds nothing to the loss
  either. `count_as_dropped`: flag them `dropped_BT` (a method's sequence drop); else clear every
  flag there (the rejection switch counts its rows itself).
  """
  d_BT = jnp.broadcast_to(drop_B[:, None], out.weight_BT.shape)
  keep = lambda a: a & ~d_BT
  return RuleOutput(
      objective_BT=jnp.where(d_BT, 0.0, out.objective_BT),
      weight_BT=jnp.where(d_BT, 0.0, out.weight_BT),
      clipped_BT=keep(out.clipped_BT),
      dropped_BT=(out.dropped_BT | d_BT) if count_as_dropped else keep(out.dropped_BT),
      dual_clipped_BT=keep(out.dual_clipped_BT),
      masked_BT=keep(out.masked_BT))


def _sg_weight_rule(x: TokenInputs, w_BT: jax.Array, *, clipped=None, dropped=None,
                    masked=None) -> RuleOutput:
  """J_t = sg(w_t) A log p(y_t): the REINFORCE form every stop-gradient weight shares."""
  w_BT = sg(w_BT)
  f = _false(w_BT)
  return RuleOutput(
      objective_BT=w_BT * x.adv_BT * x.logp_BT,
      weight_BT=w_BT,
      clipped_BT=f if clipped is None else clipped,
      dropped_BT=f if dropped is None else dropped,
      dual_clipped_BT=f,
      masked_BT=f if masked is None else masked)


# --- Token-level weight functions f(r, A) of the ratio r = p/q ------------------------------
# They define the gradient weight of each token-level rule and are also what score centering
# composes with ([SC], Eq. 9-10, docs/math.md#composing-with-an-is-weight:
# w_v = f(p_v / q_v), alpha = rho f(1/rho)). `adv` only enters
# through its sign (PPO's pessimistic clip), which is fixed along a response, so f is still a
# fixed function of the ratio at every prefix and the centered update keeps zero mean.

def _ones_weight(r, adv, cfg):
  del adv, cfg
  return jnp.ones_like(r)


def _naive_is_weight(r, adv, cfg):
  del adv, cfg
  return r


def _tis_weight(r, adv, cfg):
  del adv
  return jnp.minimum(r, cfg.tis_high)


def _cispo_weight(r, adv, cfg):
  del adv
  return jnp.clip(r, cfg.cispo_low, cfg.cispo_high)


def _mis_inside(r, cfg):
  return (r >= cfg.mis_low) & (r <= cfg.mis_high)


def _mis_weight(r, adv, cfg):
  del adv
  return jnp.where(_mis_inside(r, cfg), r, 0.0)


def _ppo_masks(r, adv, lo, hi, dual):
  """Where PPO's pessimistic min picks the clipped (constant) branch, by advantage sign.

  A > 0: min(rA, clip(r)A) is constant iff r > hi.  A < 0: it is constant iff r < lo, and
  verl's dual clip caps the loss at -dual*A, constant iff r > dual.  A = 0: no gradient anyway.
  """
  pos, neg = adv > 0, adv < 0
  dropped = (pos & (r > hi)) | (neg & (r < lo))
  dual_clipped = neg & (r > dual)
  return dropped, dual_clipped


def _ppo_weight_fn(lo_key: str, hi_key: str):
  def weight(r, adv, cfg):
    dropped, dual = _ppo_masks(r, adv, getattr(cfg, lo_key), getattr(cfg, hi_key), cfg.dual_clip)
    return jnp.where(dropped | dual, 0.0, r)
  return weight


# --- Method-owned config fields and their checks (LossConfig grows these fields) -----------

def _positive(default):
  return Param(default, lambda v: v > 0, "must be > 0")


def _band_params(key: str, lo: float, hi: float) -> dict:
  """A PPO-style trust band: it must contain ratio 1 (on-policy tokens are never clipped)."""
  return {f"{key}_low": Param(lo, lambda v: 0.0 < v <= 1.0, "must be in (0, 1]"),
          f"{key}_high": Param(hi, lambda v: v >= 1.0, "must be >= 1")}


def _ordered(key: str):
  """Cross-field check 0 <= {key}_low < {key}_high, reported on {key}_high."""
  def check(cfg):
    lo, hi = getattr(cfg, f"{key}_low"), getattr(cfg, f"{key}_high")
    require(0.0 <= lo < hi, f"{key}_high", f"need 0 <= {key}_low < {key}_high, got {lo}, {hi}")
  return check


# --- Rules -------------------------------------------------------------------------------

def _token_ratio(x: TokenInputs) -> jax.Array:
  """r_t = p(y_t) / q(y_t) with gradient through p."""
  return safe_ratio(x.logp_BT - x.logq_BT)


# Why a method has no decoupled form (`p_old_incompatible`, docs/math.md#the-decoupled-ratio).
_NO_P_OLD_SEQ_PPO = ("its trust region is the sequence's geometric-mean ratio, and the decoupled split "
                     "(band on the staleness ratio, weight from p_old / q) is defined per token")
_NO_P_OLD_TV = "its trust region is the total variation |p - q|, not a ratio whose p could be p_old"


def _pg_rule(x, cfg):
  del cfg
  return _sg_weight_rule(x, jnp.ones_like(x.logp_BT))


PG = method("pg", _pg_rule, level="token", statistic="none", weight_fn=_ones_weight)


def _naive_is_rule(x, cfg):
  return _sg_weight_rule(x, _naive_is_weight(_is_ratio(x), x.adv_BT, cfg))


NAIVE_IS = method("naive_is", _naive_is_rule, level="token", statistic="ratio", weight_fn=_naive_is_weight)


def _tis_rule(x, cfg):
  r = _is_ratio(x)
  return _sg_weight_rule(x, _tis_weight(r, x.adv_BT, cfg), clipped=r > cfg.tis_high)


TIS = method("tis", _tis_rule, level="token", statistic="ratio", weight_fn=_tis_weight,
             params={"tis_high": _positive(2.0)})


# cispo_high: 1.28 is verl's / Trinity's 1 + 0.28 (docs/math.md#cispo leaves it configurable).
def _cispo_rule(x, cfg):
  r = _is_ratio(x)
  return _sg_weight_rule(x, _cispo_weight(r, x.adv_BT, cfg),
                         clipped=(r > cfg.cispo_high) | (r < cfg.cispo_low))


CISPO = method("cispo", _cispo_rule, level="token", statistic="ratio", weight_fn=_cispo_weight,
               params={"cispo_low": Param(0.0), "cispo_high": Param(1.28)},
               check=_ordered("cispo"))


def _mis_rule(x, cfg):
  r = _is_ratio(x)
  return _sg_weight_rule(x, _mis_weight(r, x.adv_BT, cfg), dropped=~_mis_inside(r, cfg))


MIS = method("mis", _mis_rule, level="token", statistic="ratio", weight_fn=_mis_weight,
             params={"mis_low": Param(0.5), "mis_high": Param(5.0)}, check=_ordered("mis"))


def _ppo_surrogate(ratio_BT: jax.Array, x: TokenInputs, lo: float, hi: float,
                   dual: float) -> RuleOutput:
  """J_t = max(min(ratio A, clip(ratio, lo, hi) A), dual A if A < 0), gradient through ratio.

  Written as an explicit select on the branch PPO's min / max picks, so the value is exactly
  the PPO surrogate, the gradient is ratio * A * grad log p on kept tokens and exactly 0 on
  clipped ones (no tie-splitting of jnp.minimum's gradient at the band edges), and the same
  masks drive the diagnostics.
  """
  r = sg(ratio_BT)
  dropped, dual_clipped = _ppo_masks(r, x.adv_BT, lo, hi, dual)
  kept = ~(dropped | dual_clipped)
  constant = jnp.where(dual_clipped, dual, jnp.clip(r, lo, hi))
  objective = jnp.where(kept, ratio_BT, constant) * x.adv_BT
  return RuleOutput(objective, jnp.where(kept, r, 0.0), _false(r), dropped, dual_clipped, _false(r))


def _decoupled_ppo_surrogate(x: TokenInputs, lo: float, hi: float, dual: float,
                             cap: float) -> RuleOutput:
  """J_t = sg(min(p_old/q, cap)) * PPO(s_t): the band on the staleness ratio s_t = p/p_old, the
  behaviour weight p_old/q (docs/math.md#the-decoupled-ratio); `clipped_BT` marks p_old/q > cap."""
  out = _ppo_surrogate(safe_ratio(x.logp_BT - x.logp_old_BT), x, lo, hi, dual)
  b_BT = safe_ratio(x.logp_old_BT - x.logq_BT)
  w_BT = jnp.minimum(b_BT, cap)
  return out._replace(objective_BT=w_BT * out.objective_BT, weight_BT=w_BT * out.weight_BT,
                      clipped_BT=b_BT > cap)


def _ppo_family(x: TokenInputs, cfg, lo: float, hi: float) -> RuleOutput:
  """PPO's surrogate on r_t, or under `is_ratio='p_old'` its decoupled form (no weight cap)."""
  if cfg.is_ratio == "p_old":
    return _decoupled_ppo_surrogate(x, lo, hi, cfg.dual_clip, math.inf)
  return _ppo_surrogate(_token_ratio(x), x, lo, hi, cfg.dual_clip)


def _ppo_rule(x, cfg):
  return _ppo_family(x, cfg, cfg.ppo_low, cfg.ppo_high)


PPO = method("ppo", _ppo_rule, level="token", statistic="ratio",
             weight_fn=_ppo_weight_fn("ppo_low", "ppo_high"),
             params=_band_params("ppo", 0.8, 1.2))


def _dapo_rule(x, cfg):
  return _ppo_family(x, cfg, cfg.dapo_low, cfg.dapo_high)


DAPO = method("dapo", _dapo_rule, level="token", statistic="ratio",
              weight_fn=_ppo_weight_fn("dapo_low", "dapo_high"),
              params=_band_params("dapo", 0.8, 1.28))


def _seq_log_ratio(x: TokenInputs) -> tuple[jax.Array, jax.Array]:
  """S_i = sum over response tokens of l_t (stop-gradient), and the response lengths L_i (>= 1)."""
  sum_B = jnp.sum(x.mask_BT * is_log_ratio(x), axis=1)
  len_B = jnp.maximum(jnp.sum(x.mask_BT, axis=1), 1.0)
  return sum_B, len_B


def _gspo_rule(x, cfg):
  """GSPO-token (Zheng et al. 2025) as in [SC]'s Table 1: per-token ratio sg(s_i) p_t / sg(p_t).

  s_i = exp(mean_t(log p - log q)) is the geometric-mean ratio; every token of response i
  shares its value, so the PPO band (0.9997, 1.0004) and the dual clip act on the whole
  response, and the token gradients are summed (then aggregated), not response-averaged.
  """
  sum_B, len_B = _seq_log_ratio(x)
  s_B = safe_ratio(sum_B / len_B)
  ratio_BT = s_B[:, None] * jnp.exp(x.logp_BT - sg(x.logp_BT))
  return _ppo_surrogate(ratio_BT, x, cfg.gspo_low, cfg.gspo_high, cfg.dual_clip)


GSPO = method(
    "gspo", _gspo_rule, level="sequence", statistic="ratio", params=_band_params("gspo", 0.9997, 1.0004),
    sc_incompatible="its statistic is the sequence-level geometric-mean ratio, not a per-token ratio",
    p_old_incompatible=_NO_P_OLD_SEQ_PPO)


def _topr_rule(x, cfg):
  """TOPR (Le Roux et al. 2025): A < 0 responses weighted by sg(min(prod_t p/q, high)).

  The sequence ratio is the product of token ratios (not GSPO's geometric mean), clipped in
  log space so long responses cannot overflow. A >= 0 keeps weight 1.
  """
  sum_B, _ = _seq_log_ratio(x)
  log_high = jnp.log(cfg.topr_high)
  seq_log_r_BT = jnp.broadcast_to(sg(sum_B)[:, None], x.logp_BT.shape)
  neg = x.adv_BT < 0
  w = jnp.where(neg, jnp.exp(jnp.minimum(seq_log_r_BT, log_high)), 1.0)
  return _sg_weight_rule(x, w, clipped=neg & (seq_log_r_BT > log_high))


TOPR = method(
    "topr", _topr_rule, level="sequence", statistic="ratio", params={"topr_high": _positive(1.0)},
    sc_incompatible="its statistic is the sequence-level ratio, not a per-token ratio")


def _dppo_rule(x, cfg):
  """DPPO (Qi et al. 2026): ratio objective, trust region on binary TV |p(y_t) - q(y_t)|.

  A > 0 tokens are dropped when p - q > tv (probability pushed up too far), A < 0 tokens when
  q - p > tv; kept tokens get the unclipped IS objective r A (no ratio clipping, no dual clip).
  """
  ratio = _token_ratio(x)
  diff = jnp.exp(sg(x.logp_BT)) - jnp.exp(x.logq_BT)
  dropped = ((x.adv_BT > 0) & (diff > cfg.dppo_tv)) | ((x.adv_BT < 0) & (-diff > cfg.dppo_tv))
  objective = jnp.where(dropped, 0.0, ratio * x.adv_BT)
  f = _false(diff)
  return RuleOutput(objective, jnp.where(dropped, 0.0, sg(ratio)), f, dropped, f, f)


DPPO = method(
    "dppo", _dppo_rule, level="token", statistic="tv",
    params={"dppo_tv": Param(0.2, lambda v: 0.0 < v <= 1.0, "must be in (0, 1]")},
    sc_incompatible="its statistic is the binary total variation |p - q|, not a function of p_v / q_v",
    p_old_incompatible=_NO_P_OLD_TV)


def _minirl_rule(x, cfg):
  """MiniRL ([MiniRL], Eq. 7): J_t = M_t sg(min(p/q, C)) A log p.

  M_t = 0 iff (A > 0 and s_t > 1 + eps_high) or (A < 0 and s_t < 1 - eps_low), with
  s_t = p/p_old the staleness ratio. Ablations: `minirl_train_infer_is=False` uses
  min(p/p_old, C) as the weight; `minirl_clip=False` sets M_t = 1. Under `is_ratio='p_old'` the
  weight is min(p_old/q, C) (the mask already reads s_t).
  """
  if cfg.minirl_train_infer_is:
    r_is = _is_ratio(x)
  else:
    r_is = safe_ratio(sg(x.logp_BT) - x.logp_old_BT)
  w = jnp.minimum(r_is, cfg.minirl_tis_c)
  masked = _false(w)
  if cfg.minirl_clip:
    s = safe_ratio(sg(x.logp_BT) - x.logp_old_BT)
    masked = (((x.adv_BT > 0) & (s > 1.0 + cfg.minirl_eps_high))
              | ((x.adv_BT < 0) & (s < 1.0 - cfg.minirl_eps_low)))
  return _sg_weight_rule(x, jnp.where(masked, 0.0, w), clipped=r_is > cfg.minirl_tis_c,
                         masked=masked)


MINIRL = method(
    "minirl", _minirl_rule, level="token", statistic="ratio+staleness",
    sc_incompatible=("its mask M_t uses the staleness ratio p/p_old, which is only known on the "
                    "sampled token, not on the sampler's top-k head"),
    # p_old feeds the mask, and the IS weight under the -train_infer_is ablation.
    needs_logp_old=lambda cfg: cfg.minirl_clip or not cfg.minirl_train_infer_is,
    check=lambda cfg: require(
        cfg.method != "minirl" or cfg.minirl_train_infer_is or cfg.is_ratio == "current", "is_ratio",
        "'p_old' takes MiniRL's IS weight from p_old / q; minirl_train_infer_is=False replaces that "
        "weight by p / p_old: choose one"),
    params={"minirl_eps_low": Param(0.2, lambda v: 0.0 <= v < 1.0, "must be in [0, 1)"),
            "minirl_eps_high": Param(0.27, lambda v: v >= 0.0, "must be >= 0"),
            "minirl_tis_c": _positive(5.0),
            "minirl_train_infer_is": Param(True, owner_only=True),
            "minirl_clip": Param(True, owner_only=True)})


# --- The field's sequence-level corrections (docs/math.md#sequence-level-corrections) --------
# Per token l_t = log p - log q (stop-gradient; p = p_old under is_ratio='p_old'); sequence i has
# S_i = sum_t l_t over its L_i response tokens. A sequence statistic and every token weight it
# sets are stop-gradient, so the gradient is w_t A grad log p(y_t) and a dropped sequence's is 0.

_SEQ_NO_SC = ("its weight or mask is a function of the whole sequence's ratio, not of the "
              "per-token ratio p_v / q_v the centering term reweights")


def _seq_band_params(key: str, lo: float, hi: float) -> dict:
  """A sequence-ratio band: it must contain ratio 1 (an on-policy sequence is never dropped)."""
  return {f"{key}_low": Param(lo, lambda v: 0.0 <= v <= 1.0, "must be in [0, 1]"),
          f"{key}_high": Param(hi, lambda v: v >= 1.0, "must be >= 1")}


def _seq_B_to_BT(x: TokenInputs, v_B: jax.Array) -> jax.Array:
  return jnp.broadcast_to(v_B[:, None], x.logp_BT.shape)


# seq_tis_c = 2: verl's rollout correction, sequence-level TIS threshold (docs/references.md).
def _seq_tis_rule(x, cfg):
  """Every token of sequence i weighted by sg(min(exp(S_i), C)), C = seq_tis_c (in log space)."""
  sum_B, _ = _seq_log_ratio(x)
  log_c = _log(cfg.seq_tis_c)
  w_B = safe_ratio(jnp.minimum(sum_B, log_c))
  return _sg_weight_rule(x, _seq_B_to_BT(x, w_B), clipped=_seq_B_to_BT(x, sum_B > log_c))


SEQ_TIS = method("seq_tis", _seq_tis_rule, level="sequence", statistic="ratio", sc_incompatible=_SEQ_NO_SC,
                 params={"seq_tis_c": _positive(2.0)})


# [0.5, 2.0]: verl's sequence-level masked IS preset (docs/references.md).
def _seq_mis_rule(x, cfg):
  """Sequence i weighted by sg(exp(S_i)) when seq_mis_low <= exp(S_i) <= seq_mis_high, else dropped."""
  sum_B, _ = _seq_log_ratio(x)
  inside_B = (sum_B >= _log(cfg.seq_mis_low)) & (sum_B <= _log(cfg.seq_mis_high))
  out = _sg_weight_rule(x, _seq_B_to_BT(x, safe_ratio(sum_B)))
  return drop_rows(out, ~inside_B, count_as_dropped=True)


SEQ_MIS = method("seq_mis", _seq_mis_rule, level="sequence", statistic="ratio", sc_incompatible=_SEQ_NO_SC,
                 params=_seq_band_params("seq_mis", 0.5, 2.0), check=_ordered("seq_mis"))


# [0.99, 1.01] and C = 2: SkyRL's geometric sequence mask and token TIS defaults (docs/references.md).
def _geo_mask_rule(x, cfg):
  """Sequence i dropped when G_i = exp(S_i / L_i) is outside [geo_mask_low, geo_mask_high], else
  each token weighted by sg(min(r_t, geo_mask_tis_c)) (token TIS)."""
  sum_B, len_B = _seq_log_ratio(x)
  mean_B = sum_B / len_B
  inside_B = (mean_B >= _log(cfg.geo_mask_low)) & (mean_B <= _log(cfg.geo_mask_high))
  r = _is_ratio(x)
  out = _sg_weight_rule(x, jnp.minimum(r, cfg.geo_mask_tis_c), clipped=r > cfg.geo_mask_tis_c)
  return drop_rows(out, ~inside_B, count_as_dropped=True)


GEO_MASK = method("geo_mask", _geo_mask_rule, level="sequence", statistic="ratio", sc_incompatible=_SEQ_NO_SC,
                  params={**_seq_band_params("geo_mask", 0.99, 1.01),
                          "geo_mask_tis_c": _positive(2.0)},
                  check=_ordered("geo_mask"))


def _opsm_base_ok(name: str) -> bool:
  spec = METHOD_REGISTRY.get(name)
  return name != "opsm" and spec is not None and spec.level == "token" and spec.weight_fn is not None


# opsm_delta = 1e-4: slime's OPSM threshold (docs/references.md); kept sequences are plain PG.
def _opsm_rule(x, cfg):
  """Off-policy sequence masking: the `opsm_base` rule, with sequence i dropped when A_i < 0 and
  (1/L_i) sum_t (log q - log p) > opsm_delta (the sampler found it likelier than the trainer)."""
  out = METHOD_REGISTRY[cfg.opsm_base].rule(x, cfg)
  sum_B, len_B = _seq_log_ratio(x)
  drop_B = (x.adv_BT[:, 0] < 0) & (-sum_B / len_B > cfg.opsm_delta)
  return drop_rows(out, drop_B, count_as_dropped=True)


OPSM = method(
    "opsm", _opsm_rule, level="sequence", statistic="ratio", sc_incompatible=_SEQ_NO_SC,
    params={"opsm_delta": Param(1e-4, lambda v: v >= 0.0, "must be >= 0 (an on-policy sequence, "
                             "whose statistic is 0, is never dropped)"),
            "opsm_base": Param("pg", _opsm_base_ok, "must be a token-level method with a per-token "
                            "ratio weight (pg, naive_is, tis, cispo, mis, ppo, dapo)")})


# Band 0.8 / 1.2 (SPEC's PPO clip) and cap 5: AReaL's decoupled loss with its example configs'
# behav_imp_weight_cap (docs/references.md).
def _decoupled_ppo_rule(x, cfg):
  """Decoupled PPO: PPO's surrogate on s_t = p/p_old (band, dual clip) times the behaviour weight
  sg(min(p_old/q, decoupled_ppo_c)). Decoupled by definition: `is_ratio` leaves it unchanged."""
  return _decoupled_ppo_surrogate(x, cfg.decoupled_ppo_low, cfg.decoupled_ppo_high, cfg.dual_clip,
                                  cfg.decoupled_ppo_c)


DECOUPLED_PPO = method(
    "decoupled_ppo", _decoupled_ppo_rule, level="token", statistic="ratio+staleness",
    sc_incompatible=("its ratio is the staleness ratio p/p_old, and p_old is only known on the "
                           "sampled token, not on the sampler's top-k head"),
    needs_logp_old=lambda cfg: True,
    params={**_band_params("decoupled_ppo", 0.8, 1.2), "decoupled_ppo_c": _positive(5.0)})


# The built-in methods, explicitly and in one place, in the order every derived list uses (METHODS,
# the sweeps, the tests): a new method is its rule and spec above plus one entry here. loss_config
# puts them in METHOD_REGISTRY before LossConfig is created; a user's module adds its own with
# `registry.register_method`.
BUILTIN_METHODS: tuple[MethodSpec, ...] = (
    PG, NAIVE_IS, TIS, CISPO, MIS, PPO, DAPO, GSPO,
    TOPR, DPPO, MINIRL, SEQ_TIS, SEQ_MIS, GEO_MASK, OPSM, DECOUPLED_PPO)


WeightFn = Callable[[jax.Array, jax.Array, "LossConfig"], jax.Array]


def weight_fn_for(cfg: LossConfig) -> WeightFn:
  """f(r, A, cfg) of `cfg.method` for score centering; raises if the method has none."""
  fn = METHOD_REGISTRY[cfg.method].weight_fn
  if fn is None:
    raise ValueError(f"method={cfg.method!r} has no per-token ratio weight to compose score "
                     "centering with")
  return fn
