"""RL: advantages, the jitted loss of every correction method with score centering, trainer."""
# The built-in entries register here, explicitly and first: `methods` fills METHOD_REGISTRY and
# `advantages` ADVANTAGE_REGISTRY before anything reads them. The configs read the registries when
# they are built, so a user's module may register more at any time (rl_jax/rl/loss/registry.py).
from rl_jax.rl.loss import methods as _builtin_methods  # noqa: F401  pylint: disable=unused-import
from rl_jax.rl.advantages import apply_reward_mode, compute_advantages
from rl_jax.rl.loss.loss_config import METHODS, AdvantageConfig, LossConfig
from rl_jax.rl.loss.losses import (aggregate, gather_logprobs, rl_loss, rl_loss_from_hidden,
                              rl_loss_from_logprobs, score_centering_coeffs)
from rl_jax.rl.loss.methods import METHOD_REGISTRY

__all__ = [
    "AdvantageConfig", "LossConfig", "METHODS", "METHOD_REGISTRY", "aggregate",
    "apply_reward_mode", "compute_advantages", "gather_logprobs", "rl_loss",
    "rl_loss_from_hidden", "rl_loss_from_logprobs", "score_centering_coeffs",
]
