"""Per-response advantages from grouped rewards: group-centered, GRPO z-score, raw (SPEC "Advantages")."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from rl_jax.rl.loss_config import AdvantageConfig


def apply_reward_mode(rewards_B: jax.Array, reward_mode: str) -> jax.Array:
  """Maps task rewards in [0, 1] to the configured mode: '01' as is, 'pm1' to 2R - 1.

  A binary {0, 1} reward becomes {-1, +1} under 'pm1' (001, Sec. 3 / Fig. 2). The map is
  affine, so group-centered advantages only scale by 2; `raw` advantages change sign.
  """
  rewards_B = jnp.asarray(rewards_B, jnp.float32)
  if reward_mode == "01":
    return rewards_B
  if reward_mode == "pm1":
    return 2.0 * rewards_B - 1.0
  raise ValueError(f"reward_mode must be '01' or 'pm1', got {reward_mode!r}")


def compute_advantages(rewards_B: jax.Array, group_size: int, cfg: AdvantageConfig) -> jax.Array:
  """Advantage A_i of every response, the same for all of its tokens (SPEC "Advantages").

  Args:
    rewards_B: task rewards in [0, 1], grouped contiguously: responses
      [g * group_size, (g + 1) * group_size) answer prompt g; B = n_prompts * group_size.
      `cfg.reward_mode` is applied here, so pass the task's reward, not a mapped one.
    group_size: responses per prompt (static Python int).
    cfg: mode, reward mode and std epsilon.

  Returns:
    adv_B float32:
      group_centered: R_i - mean_{j in group} R_j   (000, MiniRL; 001, Eq. 13)
      grpo:           (R_i - mean) / (std + std_eps)  (z-score, std with `cfg.std_ddof`)
      raw:            R_i
  """
  rewards_B = apply_reward_mode(rewards_B, cfg.reward_mode)
  if rewards_B.ndim != 1:
    raise ValueError(f"rewards_B must be 1-D, got shape {rewards_B.shape}")
  if not isinstance(group_size, int) or group_size < 1:
    raise ValueError(f"group_size must be a positive int, got {group_size!r}")
  (b,) = rewards_B.shape
  if b % group_size:
    raise ValueError(f"batch of {b} rewards is not a whole number of groups of {group_size}")
  if cfg.mode == "raw":
    return rewards_B
  r_NG = rewards_B.reshape(b // group_size, group_size)
  centered_NG = r_NG - r_NG.mean(axis=1, keepdims=True)
  if cfg.mode == "group_centered":
    return centered_NG.reshape(b)
  if cfg.mode == "grpo":
    if cfg.std_ddof >= group_size:
      raise ValueError(f"grpo std with ddof={cfg.std_ddof} needs group_size > {cfg.std_ddof}")
    std_N1 = jnp.std(r_NG, axis=1, keepdims=True, ddof=cfg.std_ddof)
    return (centered_NG / (std_N1 + cfg.std_eps)).reshape(b)
  raise ValueError(f"advantage mode must be group_centered, grpo or raw, got {cfg.mode!r}")
