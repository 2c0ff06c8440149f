"""Frozen, validated configs of the RL loss (SPEC "Correction methods") and the advantages."""
from __future__ import annotations

import dataclasses
from typing import Literal

from rl_jax.config_utils import ConfigError, require

Method = Literal["pg", "naive_is", "tis", "cispo", "mis", "ppo", "dapo", "gspo",
                 "topr", "dppo", "minirl"]
ScoreCentering = Literal["none", "full", "topk"]
Aggregation = Literal["batch_tokens", "constant", "seq_mean"]

METHODS: tuple[str, ...] = ("pg", "naive_is", "tis", "cispo", "mis", "ppo", "dapo",
                            "gspo", "topr", "dppo", "minirl")

# Score centering subtracts E_q[f(r_v) s_v], which is only defined for a weight that is a
# function of the per-token ratio p_v / q_v at the same prefix (001, Eq. 9-10). These rules
# use something else, so the centered update would not have zero mean.
_SC_INCOMPATIBLE = {
    "gspo": "its statistic is the sequence-level geometric-mean ratio, not a per-token ratio",
    "topr": "its statistic is the sequence-level ratio, not a per-token ratio",
    "dppo": "its statistic is the binary total variation |p - q|, not a function of p_v / q_v",
    "minirl": ("its mask M_t uses the staleness ratio p/p_old, which is only known on the "
               "sampled token, not on the sampler's top-k head"),
}


def _open_band(lo: float, hi: float, key: str) -> None:
  """A PPO-style trust band must contain ratio 1 (on-policy tokens are never clipped)."""
  require(0.0 < lo <= 1.0, f"{key}_low", f"must be in (0, 1], got {lo}")
  require(hi >= 1.0, f"{key}_high", f"must be >= 1, got {hi}")


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """The RL loss: correction method, score centering, aggregation and every threshold.

  Built with `config_utils.from_dict(LossConfig, config.loss, prefix="loss")`. Defaults
  are SPEC's (Table 1 of 001; MiniRL of 000, Eq. 7). Hashable, so jitted code takes it as
  a static argument.

  Fields:
    method: correction rule (SPEC table); `pg` is plain REINFORCE.
    score_centering: 'none', 'full' (sampler's full distribution, logged with k = V) or
      'topk' (001, Eq. 7-12: head = sampler's recorded top-k, tail modelled by rho * p).
    topk: k of top-k score centering; the sampler's recorded top-k (sorted descending,
      as `lax.top_k` returns it) may be longer, and then its first `topk` entries are used.
    aggregation: 'batch_tokens' (sum / total tokens), 'constant' (sum / (B * L_max), with
      L_max the padded response length T of the arrays passed in) or 'seq_mean' (length
      normalization: mean over responses of the per-response token mean).
    *_low / *_high / dppo_tv / dual_clip: thresholds of SPEC's table.
    cispo_high: SPEC leaves it configurable; 1.28 is verl's / Trinity's 1 + 0.28.
    minirl_*: MiniRL's eps_low / eps_high on s_t = p/p_old, TIS cap C on the IS weight, and
      its ablations: `minirl_train_infer_is=False` weights by min(p/p_old, C) instead of
      min(p/q, C); `minirl_clip=False` sets M_t = 1.
    sc_eps: floor of the tail masses in rho (001, Eq. 12).
    temperature: the trainer's logits are divided by it before log-softmax, as the
      sampler did (SPEC "Log-prob semantics").
    chunk_size: 0 = unchunked; else `rl_loss_from_hidden` computes logits over the
      sequence in chunks of this many positions.
  """
  method: Method = "pg"
  score_centering: ScoreCentering = "none"
  topk: int = 128
  aggregation: Aggregation = "batch_tokens"
  tis_high: float = 2.0
  cispo_low: float = 0.0
  cispo_high: float = 1.28
  mis_low: float = 0.5
  mis_high: float = 5.0
  ppo_low: float = 0.8
  ppo_high: float = 1.2
  dapo_low: float = 0.8
  dapo_high: float = 1.28
  gspo_low: float = 0.9997
  gspo_high: float = 1.0004
  topr_high: float = 1.0
  dppo_tv: float = 0.2
  dual_clip: float = 3.0
  minirl_eps_low: float = 0.2
  minirl_eps_high: float = 0.27
  minirl_tis_c: float = 5.0
  minirl_train_infer_is: bool = True
  minirl_clip: bool = True
  sc_eps: float = 1e-6
  temperature: float = 1.0
  chunk_size: int = 0

  def __post_init__(self):
    require(self.method in METHODS, "method", f"{self.method!r} is not one of {list(METHODS)}")
    if self.score_centering != "none" and self.method in _SC_INCOMPATIBLE:
      raise ConfigError(
          f"config key 'score_centering': {self.score_centering!r} cannot be composed with "
          f"method={self.method!r}: {_SC_INCOMPATIBLE[self.method]}. Score centering composes "
          "with token-level ratio weights: pg, naive_is, tis, cispo, mis, ppo, dapo.")
    require(self.topk >= 1, "topk", f"must be >= 1, got {self.topk}")
    require(self.tis_high > 0, "tis_high", f"must be > 0, got {self.tis_high}")
    require(0.0 <= self.cispo_low < self.cispo_high, "cispo_high",
            f"need 0 <= cispo_low < cispo_high, got {self.cispo_low}, {self.cispo_high}")
    require(0.0 <= self.mis_low < self.mis_high, "mis_high",
            f"need 0 <= mis_low < mis_high, got {self.mis_low}, {self.mis_high}")
    _open_band(self.ppo_low, self.ppo_high, "ppo")
    _open_band(self.dapo_low, self.dapo_high, "dapo")
    _open_band(self.gspo_low, self.gspo_high, "gspo")
    require(self.topr_high > 0, "topr_high", f"must be > 0, got {self.topr_high}")
    require(0.0 < self.dppo_tv <= 1.0, "dppo_tv", f"must be in (0, 1], got {self.dppo_tv}")
    # verl's dual clip: the cap -c*A must sit above every ratio the band keeps for A < 0.
    require(self.dual_clip > 1.0, "dual_clip", f"must be > 1, got {self.dual_clip}")
    require(0.0 <= self.minirl_eps_low < 1.0, "minirl_eps_low",
            f"must be in [0, 1), got {self.minirl_eps_low}")
    require(self.minirl_eps_high >= 0.0, "minirl_eps_high",
            f"must be >= 0, got {self.minirl_eps_high}")
    require(self.minirl_tis_c > 0, "minirl_tis_c", f"must be > 0, got {self.minirl_tis_c}")
    if self.method != "minirl":
      require(self.minirl_train_infer_is, "minirl_train_infer_is",
              f"the MiniRL ablation only applies to method='minirl', got {self.method!r}")
      require(self.minirl_clip, "minirl_clip",
              f"the MiniRL ablation only applies to method='minirl', got {self.method!r}")
    require(0.0 < self.sc_eps < 1.0, "sc_eps", f"must be in (0, 1), got {self.sc_eps}")
    require(self.temperature > 0, "temperature", f"must be > 0, got {self.temperature}")
    require(self.chunk_size >= 0, "chunk_size",
            f"must be >= 0 (0 = unchunked), got {self.chunk_size}")

  @property
  def needs_logp_old(self) -> bool:
    """Whether the rule reads p_old (only MiniRL: its mask, or its - train_infer_is ablation)."""
    return self.method == "minirl" and (self.minirl_clip or not self.minirl_train_infer_is)

  @property
  def needs_topk(self) -> bool:
    """Whether the rule reads the sampler's top-k ids and logprobs (score centering)."""
    return self.score_centering != "none"


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
  """How rewards become per-response advantages (SPEC "Advantages").

  Fields:
    mode: 'group_centered' (R - group mean; default, MiniRL, 001), 'grpo' (z-score within
      the group) or 'raw' (A = R, for 001's reward-mode study, Fig. 2).
    reward_mode: '01' keeps task rewards in [0, 1]; 'pm1' maps them affinely to [-1, +1]
      (2R - 1), so a binary reward becomes {-1, +1}.
    std_eps: added to the group std in 'grpo'.
    std_ddof: 0 = population std of the group; 1 = sample std (torch.std, as verl / TRL).
  """
  mode: Literal["group_centered", "grpo", "raw"] = "group_centered"
  reward_mode: Literal["01", "pm1"] = "01"
  std_eps: float = 1e-6
  std_ddof: int = 0

  def __post_init__(self):
    require(self.std_eps >= 0, "std_eps", f"must be >= 0, got {self.std_eps}")
    require(self.std_ddof in (0, 1), "std_ddof", f"must be 0 or 1, got {self.std_ddof}")
