"""RL: advantages, the jitted loss of every correction method with score centering, trainer."""
# The loss methods' table fills where LossConfig is created (loss_config, from
# methods.BUILTIN_METHODS); the estimators' where they are defined (advantages). The configs read
# the tables when they are built, so a user's module may register more at any time.
from rl_jax.rl.advantages import apply_reward_mode, compute_advantages
from rl_jax.rl.loss.loss_config import METHODS, AdvantageConfig, LossConfig
from rl_jax.rl.loss.losses import (aggregate, gather_logprobs, rl_loss, rl_loss_from_hidden,
                              rl_loss_from_logprobs, score_centering_coeffs)
from rl_jax.rl.loss.registry import METHOD_REGISTRY

__all__ = [
    "AdvantageConfig", "LossConfig", "METHODS", "METHOD_REGISTRY", "aggregate",
    "apply_reward_mode", "compute_advantages", "gather_logprobs", "rl_loss",
    "rl_loss_from_hidden", "rl_loss_from_logprobs", "score_centering_coeffs",
]
