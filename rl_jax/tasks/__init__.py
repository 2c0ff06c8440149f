"""Verifiable tasks for SFT / RL: a registry mapping names to Countdown configs, prompts and rewards."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from rl_jax.config_utils import ConfigError
from rl_jax.tasks import countdown
from rl_jax.tasks import reward as reward_lib
from rl_jax.tasks.countdown import CountdownConfig, Problem, Split
from rl_jax.tasks.reward import RewardDetails

# Task name -> Countdown preset.
_TASKS = {"countdown": "paper", "countdown_easy": "easy"}


@dataclasses.dataclass(frozen=True)
class Task:
  """A task bound to its config: data, prompt / completion text and reward R(x, y)."""
  name: str
  config: CountdownConfig

  def make_problem(self, seed: int, split: Split, index: int) -> Problem:
    return countdown.make_problem(self.config, seed, split, index)

  def make_problems(self, seed: int, split: Split, start: int, count: int) -> list[Problem]:
    return countdown.make_problems(self.config, seed, split, start, count)

  def prompt(self, problem: Problem) -> str:
    return countdown.format_prompt(problem, self.config.prompt_style, self.config.ops)

  def completion(self, problem: Problem) -> str:
    """The SFT target following prompt(problem) (tokenizer adds eos)."""
    return countdown.format_completion(problem, self.config.prompt_style)

  @property
  def response_prefix(self) -> str:
    """Answer-block text already in the prompt; reward() prepends it to the completion."""
    return countdown.response_prefix(self.config.prompt_style)

  def reward_details(self, problem: Problem, completion: str) -> RewardDetails:
    """Scores the sampled completion (the text after the prompt); never raises."""
    text = self.response_prefix + completion if isinstance(completion, str) else completion
    return reward_lib.score_countdown(text, problem.numbers, problem.target,
                                      integer_intermediate=self.config.integer_intermediate)

  def reward(self, problem: Problem, completion: str) -> float:
    """Binary reward in {0, 1} (see reward.score_countdown); never raises."""
    return self.reward_details(problem, completion).reward


def list_tasks() -> list[str]:
  return sorted(_TASKS)


def get_task(name: str, overrides: Mapping[str, Any] | None = None) -> Task:
  """'countdown' (paper preset) or 'countdown_easy', with optional CountdownConfig overrides.

  Unknown names or override keys raise ConfigError naming them.
  """
  if name not in _TASKS:
    raise ConfigError(f"unknown task {name!r}; valid tasks: {list_tasks()}")
  return Task(name, countdown.preset(_TASKS[name], **dict(overrides or {})))


__all__ = ["CountdownConfig", "Problem", "RewardDetails", "Task", "get_task", "list_tasks"]
