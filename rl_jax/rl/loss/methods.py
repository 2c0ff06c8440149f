"""The correction rules of docs/math.md#correction-methods: per-token weights, clips, drops and masks, each registered."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from rl_jax.config_utils import require
from rl_jax.rl.loss.registry import METHOD_REGISTRY, Param, register_method

if TYPE_CHECKING:  # loss_config imports this module (to fill the registry) before LossConfig exists
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
  """
  logp_BT: jax.Array
  logq_BT: jax.Array
  logp_old_BT: Optional[jax.Array]
  adv_BT: jax.Array
  mask_BT: jax.Array


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


@register_method("pg", level="token", statistic="none", weight_fn=_ones_weight)
def _pg_rule(x, cfg):
  del cfg
  return _sg_weight_rule(x, jnp.ones_like(x.logp_BT))


@register_method("naive_is", level="token", statistic="ratio", weight_fn=_naive_is_weight)
def _naive_is_rule(x, cfg):
  return _sg_weight_rule(x, _naive_is_weight(sg(_token_ratio(x)), x.adv_BT, cfg))


@register_method("tis", level="token", statistic="ratio", weight_fn=_tis_weight,
                 params={"tis_high": _positive(2.0)})
def _tis_rule(x, cfg):
  r = sg(_token_ratio(x))
  return _sg_weight_rule(x, _tis_weight(r, x.adv_BT, cfg), clipped=r > cfg.tis_high)


# cispo_high: 1.28 is verl's / Trinity's 1 + 0.28 (docs/math.md#cispo leaves it configurable).
@register_method("cispo", level="token", statistic="ratio", weight_fn=_cispo_weight,
                 params={"cispo_low": Param(0.0), "cispo_high": Param(1.28)},
                 check=_ordered("cispo"))
def _cispo_rule(x, cfg):
  r = sg(_token_ratio(x))
  return _sg_weight_rule(x, _cispo_weight(r, x.adv_BT, cfg),
                         clipped=(r > cfg.cispo_high) | (r < cfg.cispo_low))


@register_method("mis", level="token", statistic="ratio", weight_fn=_mis_weight,
                 params={"mis_low": Param(0.5), "mis_high": Param(5.0)}, check=_ordered("mis"))
def _mis_rule(x, cfg):
  r = sg(_token_ratio(x))
  return _sg_weight_rule(x, _mis_weight(r, x.adv_BT, cfg), dropped=~_mis_inside(r, cfg))


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


@register_method("ppo", level="token", statistic="ratio",
                 weight_fn=_ppo_weight_fn("ppo_low", "ppo_high"),
                 params=_band_params("ppo", 0.8, 1.2))
def _ppo_rule(x, cfg):
  return _ppo_surrogate(_token_ratio(x), x, cfg.ppo_low, cfg.ppo_high, cfg.dual_clip)


@register_method("dapo", level="token", statistic="ratio",
                 weight_fn=_ppo_weight_fn("dapo_low", "dapo_high"),
                 params=_band_params("dapo", 0.8, 1.28))
def _dapo_rule(x, cfg):
  return _ppo_surrogate(_token_ratio(x), x, cfg.dapo_low, cfg.dapo_high, cfg.dual_clip)


def _seq_log_ratio(x: TokenInputs) -> tuple[jax.Array, jax.Array]:
  """Sum over response tokens of log p - log q, and the response lengths L_i (>= 1)."""
  sum_B = jnp.sum(x.mask_BT * (x.logp_BT - x.logq_BT), axis=1)
  len_B = jnp.maximum(jnp.sum(x.mask_BT, axis=1), 1.0)
  return sum_B, len_B


@register_method(
    "gspo", level="sequence", statistic="ratio", params=_band_params("gspo", 0.9997, 1.0004),
    sc_incompatible="its statistic is the sequence-level geometric-mean ratio, not a per-token ratio")
def _gspo_rule(x, cfg):
  """GSPO-token (Zheng et al. 2025) as in [SC]'s Table 1: per-token ratio sg(s_i) p_t / sg(p_t).

  s_i = exp(mean_t(log p - log q)) is the geometric-mean ratio; every token of response i
  shares its value, so the PPO band (0.9997, 1.0004) and the dual clip act on the whole
  response, and the token gradients are summed (then aggregated), not response-averaged.
  """
  sum_B, len_B = _seq_log_ratio(x)
  s_B = safe_ratio(sg(sum_B / len_B))
  ratio_BT = s_B[:, None] * jnp.exp(x.logp_BT - sg(x.logp_BT))
  return _ppo_surrogate(ratio_BT, x, cfg.gspo_low, cfg.gspo_high, cfg.dual_clip)


@register_method(
    "topr", level="sequence", statistic="ratio", params={"topr_high": _positive(1.0)},
    sc_incompatible="its statistic is the sequence-level ratio, not a per-token ratio")
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


@register_method(
    "dppo", level="token", statistic="tv",
    params={"dppo_tv": Param(0.2, lambda v: 0.0 < v <= 1.0, "must be in (0, 1]")},
    sc_incompatible="its statistic is the binary total variation |p - q|, not a function of p_v / q_v")
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


@register_method(
    "minirl", level="token", statistic="ratio+staleness",
    sc_incompatible=("its mask M_t uses the staleness ratio p/p_old, which is only known on the "
                     "sampled token, not on the sampler's top-k head"),
    # p_old feeds the mask, and the IS weight under the -train_infer_is ablation.
    needs_logp_old=lambda cfg: cfg.minirl_clip or not cfg.minirl_train_infer_is,
    params={"minirl_eps_low": Param(0.2, lambda v: 0.0 <= v < 1.0, "must be in [0, 1)"),
            "minirl_eps_high": Param(0.27, lambda v: v >= 0.0, "must be >= 0"),
            "minirl_tis_c": _positive(5.0),
            "minirl_train_infer_is": Param(True, owner_only=True),
            "minirl_clip": Param(True, owner_only=True)})
def _minirl_rule(x, cfg):
  """MiniRL ([MiniRL], Eq. 7): J_t = M_t sg(min(p/q, C)) A log p.

  M_t = 0 iff (A > 0 and s_t > 1 + eps_high) or (A < 0 and s_t < 1 - eps_low), with
  s_t = p/p_old the staleness ratio. Ablations: `minirl_train_infer_is=False` uses
  min(p/p_old, C) as the weight; `minirl_clip=False` sets M_t = 1.
  """
  if cfg.minirl_train_infer_is:
    denom = x.logq_BT
  else:
    denom = x.logp_old_BT
  r_is = safe_ratio(sg(x.logp_BT) - denom)
  w = jnp.minimum(r_is, cfg.minirl_tis_c)
  masked = _false(w)
  if cfg.minirl_clip:
    s = safe_ratio(sg(x.logp_BT) - x.logp_old_BT)
    masked = (((x.adv_BT > 0) & (s > 1.0 + cfg.minirl_eps_high))
              | ((x.adv_BT < 0) & (s < 1.0 - cfg.minirl_eps_low)))
  return _sg_weight_rule(x, jnp.where(masked, 0.0, w), clipped=r_is > cfg.minirl_tis_c,
                         masked=masked)


WeightFn = Callable[[jax.Array, jax.Array, "LossConfig"], jax.Array]


def weight_fn_for(cfg: LossConfig) -> WeightFn:
  """f(r, A, cfg) of `cfg.method` for score centering; raises if the method has none."""
  fn = METHOD_REGISTRY[cfg.method].weight_fn
  if fn is None:
    raise ValueError(f"method={cfg.method!r} has no per-token ratio weight to compose score "
                     "centering with")
  return fn
