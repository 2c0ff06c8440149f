"""Per-response advantages from grouped rewards: registered estimators and reward modes, and their config."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from rl_jax.config_registry import (Param, add_entry, add_registry_params, check_registry_params,
                                    require_registered)


@dataclasses.dataclass(frozen=True)
class EstimatorSpec:
  """One advantage estimator: fn(rewards_NG, cfg) -> adv_NG on [groups, group size] rewards."""
  name: str
  fn: Callable
  params: dict = dataclasses.field(default_factory=dict)
  check: Optional[Callable[[Any], None]] = None   # cfg -> None, raising ConfigError


ADVANTAGE_REGISTRY: dict[str, EstimatorSpec] = {}   # name -> spec, in registration order
REWARD_MODE_REGISTRY: dict[str, Callable] = {}      # name -> rewards_B -> rewards_B


def register_advantage(name: str, *, params: Optional[dict] = None, check=None):
  """Decorator registering `fn(rewards_NG, cfg) -> adv_NG` as advantage estimator `name`."""
  def deco(fn):
    add_entry(ADVANTAGE_REGISTRY, name, EstimatorSpec(name, fn, dict(params or {}), check))
    return fn
  return deco


def register_reward_mode(name: str):
  """Decorator registering `fn(rewards_B) -> rewards_B` (task rewards in [0, 1]) as reward mode `name`."""
  def deco(fn):
    if name in REWARD_MODE_REGISTRY:
      raise ValueError(f"reward mode {name!r} is already registered")
    REWARD_MODE_REGISTRY[name] = fn
    return fn
  return deco


# --- Reward modes: task rewards in [0, 1] -> the rewards the estimator sees ------------------

@register_reward_mode("01")
def _rewards_01(rewards_B):
  return rewards_B


@register_reward_mode("pm1")
def _rewards_pm1(rewards_B):
  return 2.0 * rewards_B - 1.0


def overlong_penalty(lengths_B: np.ndarray, max_new_tokens: int, buffer: int, factor: float) -> np.ndarray:
  """DAPO's soft overlong punishment ([DAPO], Sec. 3.4) per response of `lengths_B` tokens:
  0 up to max_new_tokens - buffer, then -factor * (length - (max_new_tokens - buffer)) / buffer,
  reaching -factor at max_new_tokens (no response is longer). buffer 0: all zeros."""
  lengths_B = np.asarray(lengths_B, np.float32)
  if buffer <= 0:
    return np.zeros_like(lengths_B)
  return -factor * np.clip(lengths_B - (max_new_tokens - buffer), 0.0, buffer) / buffer


# --- Estimators on [N groups, G responses] rewards ---------------------------------------------

@register_advantage("group_centered")
def _group_centered(r_NG, cfg):
  """R_i - mean_{j in group} R_j   ([MiniRL]; [SC], Eq. 13)."""
  del cfg
  return r_NG - r_NG.mean(axis=1, keepdims=True)


@register_advantage("grpo", params={
    "std_eps": Param(1e-6, lambda v: v >= 0, "must be >= 0"),
    "std_ddof": Param(0, lambda v: v in (0, 1), "must be 0 or 1")})
def _grpo(r_NG, cfg):
  """(R_i - mean) / (std + std_eps): the z-score within the group, std with `cfg.std_ddof`."""
  g = r_NG.shape[1]
  if cfg.std_ddof >= g:
    raise ValueError(f"grpo std with ddof={cfg.std_ddof} needs group_size > {cfg.std_ddof}")
  std_N1 = jnp.std(r_NG, axis=1, keepdims=True, ddof=cfg.std_ddof)
  return (r_NG - r_NG.mean(axis=1, keepdims=True)) / (std_N1 + cfg.std_eps)


@register_advantage("raw")
def _raw(r_NG, cfg):
  """A = R (for [SC]'s reward-mode study, Fig. 2)."""
  del cfg
  return r_NG


@add_registry_params(ADVANTAGE_REGISTRY)
@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
  """How rewards become per-response advantages (docs/math.md#advantages).

  Fields:
    mode: a registered estimator: 'group_centered' (R - group mean; default, [MiniRL], [SC]),
      'grpo' (z-score within the group) or 'raw' (A = R, for [SC]'s reward-mode study, Fig. 2).
    reward_mode: a registered reward mode: '01' keeps task rewards in [0, 1]; 'pm1' maps
      them affinely to [-1, +1] (2R - 1), so a binary reward becomes {-1, +1}.
    Estimator-owned fields are added from the registry (`params=`): grpo's std_eps (added
      to the group std) and std_ddof (0 = population std of the group; 1 = sample std,
      torch.std, as verl / TRL).
  """
  mode: str = "group_centered"
  reward_mode: str = "01"
  # The entry-owned fields (name, value), from the registry when built (`add_registry_params`).
  registry_params: tuple = ()

  def __post_init__(self):
    require_registered(self.mode, ADVANTAGE_REGISTRY, "mode")
    require_registered(self.reward_mode, REWARD_MODE_REGISTRY, "reward_mode")
    check_registry_params(self, ADVANTAGE_REGISTRY, self.mode, "mode")


def apply_reward_mode(rewards_B: jax.Array, reward_mode: str) -> jax.Array:
  """Maps task rewards in [0, 1] to the configured mode: '01' as is, 'pm1' to 2R - 1.

  A binary {0, 1} reward becomes {-1, +1} under 'pm1' ([SC], Sec. 3 / Fig. 2). The map is
  affine, so group-centered advantages only scale by 2; `raw` advantages change sign.
  """
  if reward_mode not in REWARD_MODE_REGISTRY:
    raise ValueError(f"reward_mode must be one of {list(REWARD_MODE_REGISTRY)}, got {reward_mode!r}")
  return REWARD_MODE_REGISTRY[reward_mode](jnp.asarray(rewards_B, jnp.float32))


def compute_advantages(rewards_B: jax.Array, group_size: int, cfg: AdvantageConfig) -> jax.Array:
  """Advantage A_i of every response, the same for all of its tokens (docs/math.md#advantages).

  Args:
    rewards_B: task rewards in [0, 1], grouped contiguously: responses
      [g * group_size, (g + 1) * group_size) answer prompt g; B = n_prompts * group_size.
      `cfg.reward_mode` is applied here, so pass the task's reward, not a mapped one.
    group_size: responses per prompt (static Python int).
    cfg: estimator (`mode`), reward mode and the estimator's parameters.

  Returns:
    adv_B float32, the registered estimator `cfg.mode` applied group by group.
  """
  rewards_B = apply_reward_mode(rewards_B, cfg.reward_mode)
  if rewards_B.ndim != 1:
    raise ValueError(f"rewards_B must be 1-D, got shape {rewards_B.shape}")
  if not isinstance(group_size, int) or group_size < 1:
    raise ValueError(f"group_size must be a positive int, got {group_size!r}")
  (b,) = rewards_B.shape
  if b % group_size:
    raise ValueError(f"batch of {b} rewards is not a whole number of groups of {group_size}")
  if cfg.mode not in ADVANTAGE_REGISTRY:
    raise ValueError(f"advantage mode must be one of {list(ADVANTAGE_REGISTRY)}, got {cfg.mode!r}")
  r_NG = rewards_B.reshape(b // group_size, group_size)
  return ADVANTAGE_REGISTRY[cfg.mode].fn(r_NG, cfg).reshape(b)
