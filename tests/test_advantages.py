"""Advantages: group-centered, GRPO z-score, raw, and the {0,1} / {-1,+1} reward modes."""
import numpy as np
import pytest

from rl_jax.config_utils import ConfigError, from_dict
from rl_jax.rl.advantages import apply_reward_mode, compute_advantages
from rl_jax.rl.loss.loss_config import AdvantageConfig

# Two prompts x four responses, binary task rewards.
REWARDS = np.array([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0], np.float32)


def test_reward_modes_map_binary_rewards():
  np.testing.assert_array_equal(apply_reward_mode(REWARDS, "01"), REWARDS)
  np.testing.assert_array_equal(apply_reward_mode(REWARDS, "pm1"), 2 * REWARDS - 1)
  assert set(np.asarray(apply_reward_mode(REWARDS, "pm1")).tolist()) == {-1.0, 1.0}
  with pytest.raises(ValueError, match="reward_mode"):
    apply_reward_mode(REWARDS, "bad")


def test_group_centered_closed_form():
  adv = np.asarray(compute_advantages(REWARDS, 4, AdvantageConfig()))
  # Group means 1/4 and 3/4.
  np.testing.assert_allclose(adv, [0.75, -0.25, -0.25, -0.25, 0.25, 0.25, -0.75, 0.25],
                             rtol=0, atol=1e-7)
  np.testing.assert_allclose(adv.reshape(2, 4).sum(1), 0.0, atol=1e-6)


def test_pm1_doubles_group_centered_and_flips_raw():
  a01 = compute_advantages(REWARDS, 4, AdvantageConfig(reward_mode="01"))
  apm = compute_advantages(REWARDS, 4, AdvantageConfig(reward_mode="pm1"))
  np.testing.assert_allclose(apm, 2 * np.asarray(a01), atol=1e-6)
  raw = compute_advantages(REWARDS, 4, AdvantageConfig(mode="raw", reward_mode="pm1"))
  np.testing.assert_array_equal(raw, 2 * REWARDS - 1)
  raw01 = compute_advantages(REWARDS, 4, AdvantageConfig(mode="raw"))
  np.testing.assert_array_equal(raw01, REWARDS)


def test_grpo_zscore_closed_form():
  r = np.array([1.0, 0.0, 0.0, 1.0, 2.0, 0.0], np.float32)  # groups of 3
  adv = np.asarray(compute_advantages(r, 3, AdvantageConfig(mode="grpo")))
  # Group 1: mean 1/3, population std sqrt(2)/3; group 2: mean 1, std sqrt(2/3).
  s1, s2 = np.sqrt(2.0) / 3.0, np.sqrt(2.0 / 3.0)
  want = [(2 / 3) / (s1 + 1e-6), (-1 / 3) / (s1 + 1e-6), (-1 / 3) / (s1 + 1e-6),
          0.0, 1.0 / (s2 + 1e-6), -1.0 / (s2 + 1e-6)]
  np.testing.assert_allclose(adv, want, rtol=1e-6)
  adv1 = np.asarray(compute_advantages(r, 3, AdvantageConfig(mode="grpo", std_ddof=1)))
  s1u, s2u = np.sqrt(1.0 / 3.0), 1.0  # sample std
  np.testing.assert_allclose(adv1[:3], np.array([2, -1, -1]) / 3 / (s1u + 1e-6), rtol=1e-6)
  np.testing.assert_allclose(adv1[3:], np.array([0, 1, -1]) / (s2u + 1e-6), rtol=1e-6)


def test_grpo_constant_group_is_zero_not_nan():
  adv = compute_advantages(np.ones(4, np.float32), 4, AdvantageConfig(mode="grpo"))
  np.testing.assert_array_equal(adv, np.zeros(4))


def test_errors():
  with pytest.raises(ValueError, match="whole number of groups"):
    compute_advantages(REWARDS, 3, AdvantageConfig())
  with pytest.raises(ConfigError, match="adv.mode"):
    from_dict(AdvantageConfig, {"mode": "zscore"}, prefix="adv")
  with pytest.raises(ConfigError, match="reward_mode"):
    from_dict(AdvantageConfig, {"reward_mode": "+1/-1"}, prefix="adv")
  with pytest.raises(ValueError, match="ddof"):
    compute_advantages(np.ones(2, np.float32), 1, AdvantageConfig(mode="grpo", std_ddof=1))


def test_overlong_penalty_is_dapos_soft_punishment():
  """0 up to T - buffer tokens, then linear to -factor at T (T = 16, buffer = 4, factor 0.5)."""
  from rl_jax.rl.advantages import overlong_penalty
  got = overlong_penalty(np.array([3, 12, 13, 14, 16]), max_new_tokens=16, buffer=4, factor=0.5)
  np.testing.assert_allclose(got, [0.0, 0.0, -0.125, -0.25, -0.5])
  assert not overlong_penalty(np.array([16]), 16, 0, 1.0).any()   # buffer 0: off

