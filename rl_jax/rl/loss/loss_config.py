"""Frozen, validated config of the RL loss (docs/math.md#correction-methods); methods come from the registry."""
from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Literal

from rl_jax.config_utils import ConfigError, require
from rl_jax.config_registry import (add_registry_params, check_registry_params, registry_fields_now,
                                    require_registered)
from rl_jax.rl.advantages import AdvantageConfig  # re-exported: the config sections live together
from rl_jax.rl.loss.methods import BUILTIN_METHODS
from rl_jax.rl.loss.registry import METHOD_REGISTRY, add_method

ScoreCentering = Literal["none", "full", "topk"]
Aggregation = Literal["batch_tokens", "constant", "seq_mean"]
# "replay" is kept_set's old name, a deprecated alias ("replay" is routing replay's word).
SamplingMask = Literal["none", "kept_set", "replay"]
IsRatio = Literal["current", "p_old"]
Rejection = Literal["none", "k1", "k2", "k3"]
RejectionReduce = Literal["mean", "sum", "max"]

# The built-in methods go in the table here, first and in their listed order (methods.BUILTIN_METHODS),
# before LossConfig is created from it. METHODS names them, for sweeps and tests;
# `registered_methods()` also has those a user's module registered since.
for _spec in BUILTIN_METHODS:
  add_method(_spec)
METHODS: tuple[str, ...] = tuple(spec.name for spec in BUILTIN_METHODS)


def registered_methods() -> tuple[str, ...]:
  """Every method registered so far, built-in or a user's, in registration order."""
  return tuple(METHOD_REGISTRY)


def sc_composable_methods() -> list[str]:
  """Methods whose per-token ratio weight score centering composes with.

  [SC], Eq. 9-10; docs/math.md#composing-with-an-is-weight.
  """
  return [m for m, spec in METHOD_REGISTRY.items() if spec.weight_fn is not None]


@add_registry_params(METHOD_REGISTRY)
@dataclasses.dataclass(frozen=True)
@registry_fields_now(METHOD_REGISTRY)
class LossConfig:
  """The RL loss: correction method, score centering, aggregation and every threshold.

  Built with `config_utils.from_dict(LossConfig, config.loss, prefix="loss")`. Defaults
  are those of docs/math.md#correction-methods ([SC] Table 1; [MiniRL] Eq. 7). Hashable, so
  jitted code takes it as a static argument.

  Fields:
    method: a registered correction rule (METHODS: docs/math.md#correction-methods, registered in
      methods.py); `pg` is plain REINFORCE. Validated against the registry, so the error
      lists the valid names.
    score_centering: 'none', 'full' (sampler's full distribution, logged with k = V) or
      'topk' ([SC], Eq. 7-12, docs/math.md#top-k-score-centering: head = sampler's recorded
      top-k, tail modelled by rho * p).
    topk: k of top-k score centering; the sampler's recorded top-k (sorted descending,
      as `lax.top_k` returns it) may be longer, and then its first `topk` entries are used.
    aggregation: 'batch_tokens' (sum / total tokens), 'constant' (sum / (B * L_max), with
      L_max the padded response length T of the arrays passed in) or 'seq_mean' (length
      normalization: mean over responses of the per-response token mean).
    dual_clip: verl's dual clip of the PPO family (ppo, dapo, gspo), shared by them.
    sc_eps: floor of the tail masses in rho ([SC], Eq. 12).
    temperature: the trainer's logits are divided by it before log-softmax, as the
      sampler did (docs/math.md#log-prob-conventions).
    chunk_size: 0 = unchunked; else `rl_loss_from_hidden` computes logits over the
      sequence in chunks of this many positions.
    sampling_mask: what the policies are when the sampler truncates (top-k / top-p;
      docs/math.md#truncated-sampling). 'none': p and q over the full temperature-scaled
      vocabulary (the truncation is part of the behaviour, not of the target). 'kept_set': the
      target is the truncated policy: the trainer restricts p to the kept set the sampler drew
      each token from (rebuilt from `Rollout.trunc_*`) and renormalizes it before every ratio,
      KL, score-centering term and entropy; a token outside the rebuilt set is masked and
      counted (`sampling_mask/outside_frac`). 'replay' is its deprecated old name: it warns
      (DeprecationWarning) and the config holds 'kept_set', so it behaves identically.
    is_ratio: which trainer policy p the IS weights and masks read in l_t = log p - log q
      (docs/math.md#the-decoupled-ratio). 'current': p_theta. 'p_old': the decoupled form, the IS
      weight from the rollout-time trainer p_old / q and, for the PPO family, the clip on the
      staleness ratio p_theta / p_old; needs p_old. Refused by name for methods without a decoupled
      form (gspo, dppo) and with score centering (its head weights would need p_old at every
      head id) except for pg.
    rejection, rejection_reduce, rejection_threshold: the rejection switch
      (docs/math.md#rejection), applied before any method like aggregation: the per-token
      estimator ('k1' = -l_t, 'k2' = l_t^2 / 2, 'k3' = exp(l_t) - 1 - l_t; 'none' = off) reduced
      over each sequence ('mean', 'sum', 'max'); a sequence whose statistic is above the threshold
      carries no objective and no gradient (the aggregation's denominator still counts it).
      Default threshold 0.01: verl's k3-mean preset.
    weight_norm: divide every per-token weight (and the objective it scales, and the
      score-centering coefficients) by the stop-gradient mean weight over the batch's kept
      response tokens, after truncation (docs/math.md#weight-normalization). Needs the whole
      mini-batch in one call: the job refuses it with update micro-batches.
    Method-owned fields (each method's thresholds: tis_high, cispo_low / cispo_high,
      mis_low / mis_high, ppo_*, dapo_*, gspo_*, topr_high, dppo_tv, minirl_eps_low /
      minirl_eps_high / minirl_tis_c and MiniRL's ablation switches minirl_train_infer_is /
      minirl_clip; seq_tis_c, seq_mis_low / seq_mis_high, geo_mask_low / geo_mask_high /
      geo_mask_tis_c, opsm_delta / opsm_base, decoupled_ppo_low / decoupled_ppo_high /
      decoupled_ppo_c) are declared where the method registers (methods.py, `params=`); those
      registered when this class is created become its declared fields (`registry_fields_now`,
      listed by `dataclasses.fields`), and a method registered later, from a user's module,
      owns fields of every config built after it (`add_registry_params`, in `registry_params`);
      the defaults and checks are those of docs/math.md#correction-methods.
  """
  method: str = "pg"
  score_centering: ScoreCentering = "none"
  topk: int = 128
  aggregation: Aggregation = "batch_tokens"
  dual_clip: float = 3.0
  sc_eps: float = 1e-6
  temperature: float = 1.0
  chunk_size: int = 0
  sampling_mask: SamplingMask = "none"
  is_ratio: IsRatio = "current"
  rejection: Rejection = "none"
  rejection_reduce: RejectionReduce = "mean"
  rejection_threshold: float = 0.01
  weight_norm: bool = False
  # Fields of entries registered after this class was created (name, value), from the registry
  # when a config is built (`add_registry_params`); the built-in methods' are declared fields.
  registry_params: tuple = ()

  def __post_init__(self):
    require_registered(self.method, METHOD_REGISTRY, "method")
    reason = METHOD_REGISTRY[self.method].sc_incompatible
    if self.score_centering != "none" and reason is not None:
      raise ConfigError(
          f"config key 'score_centering': {self.score_centering!r} cannot be composed with "
          f"method={self.method!r}: {reason}. Score centering composes with token-level "
          f"ratio weights: {', '.join(sc_composable_methods())}.")
    require(self.topk >= 1, "topk", f"must be >= 1, got {self.topk}")
    # verl's dual clip: the cap -c*A must sit above every ratio the band keeps for A < 0.
    require(self.dual_clip > 1.0, "dual_clip", f"must be > 1, got {self.dual_clip}")
    check_registry_params(self, METHOD_REGISTRY, self.method, "method")
    require(0.0 < self.sc_eps < 1.0, "sc_eps", f"must be in (0, 1), got {self.sc_eps}")
    require(self.temperature > 0, "temperature", f"must be > 0, got {self.temperature}")
    require(self.chunk_size >= 0, "chunk_size",
            f"must be >= 0 (0 = unchunked), got {self.chunk_size}")
    if self.sampling_mask == "replay":
      warnings.warn("loss.sampling_mask='replay' is deprecated: the truncated-sampling target is now "
                    "named 'kept_set' (it means the same; 'replay' names routing replay)",
                    DeprecationWarning, stacklevel=3)
      object.__setattr__(self, "sampling_mask", "kept_set")
    require(self.sampling_mask in ("none", "kept_set"), "sampling_mask",
            f"must be 'none' or 'kept_set', got {self.sampling_mask!r}")
    require(self.is_ratio in ("current", "p_old"), "is_ratio",
            f"must be 'current' or 'p_old', got {self.is_ratio!r}")
    if self.is_ratio == "p_old":
      why = METHOD_REGISTRY[self.method].p_old_incompatible
      require(why is None, "is_ratio", f"'p_old' has no decoupled form for method={self.method!r}: {why}")
      require(self.score_centering == "none" or self.method == "pg", "is_ratio",
              f"'p_old' with score_centering={self.score_centering!r} and method={self.method!r}: "
              "the centering term's head weights f(p_v / q_v) would need p_old at every head id, "
              "and the p_old forward gathers only the sampled token")
    require(self.rejection in ("none", "k1", "k2", "k3"), "rejection",
            f"must be 'none', 'k1', 'k2' or 'k3', got {self.rejection!r}")
    require(self.rejection_reduce in ("mean", "sum", "max"), "rejection_reduce",
            f"must be 'mean', 'sum' or 'max', got {self.rejection_reduce!r}")
    require(not math.isnan(self.rejection_threshold), "rejection_threshold", "must not be NaN")

  @property
  def kept_set_mask(self) -> bool:
    """Whether the target policy is the sampler's truncated one (`sampling_mask='kept_set'`)."""
    return self.sampling_mask == "kept_set"

  @property
  def needs_logp_old(self) -> bool:
    """Whether the loss reads p_old: the method says so (MiniRL, decoupled PPO), or
    `is_ratio='p_old'` takes every IS weight from it."""
    return self.is_ratio == "p_old" or bool(METHOD_REGISTRY[self.method].needs_logp_old(self))

  @property
  def needs_topk(self) -> bool:
    """Whether the rule reads the sampler's top-k ids and logprobs (score centering)."""
    return self.score_centering != "none"
