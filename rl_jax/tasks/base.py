"""The Task protocol every verifiable task implements, and the task registry (register_task / get_task)."""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Protocol, runtime_checkable

from rl_jax.config_utils import ConfigError

Problem = Any   # each task defines its own (hashable, comparable) problem type


@runtime_checkable
class RewardInfo(Protocol):
  """What a task's evaluator found in one completion (e.g. tasks.reward.RewardDetails)."""
  reward: float
  error: Optional[str]   # '' or None when the completion is correct, else a short error code


@runtime_checkable
class Task(Protocol):
  """A verifiable task bound to its config: data, prompt / completion text and reward R(x, y).

  What the SFT job, the RL trainer, the data batching and the notebook call; a task needs
  nothing else (its config, presets or extra helpers are its own business).
  """
  name: str

  def make_problems(self, seed: int, split: str, start: int, count: int) -> list:
    """Problems start .. start + count - 1 of `split` ('train' or 'eval'), deterministic in seed."""

  def prompt(self, problem: Problem) -> str:
    """The prompt text the model continues (the tokenizer adds bos)."""

  def completion(self, problem: Problem) -> str:
    """The SFT target following prompt(problem) (the tokenizer adds eos)."""

  def reward(self, problem: Problem, completion: str) -> float:
    """R(x, y) in [0, 1] of a sampled completion (the text after the prompt); never raises."""

  def reward_details(self, problem: Problem, completion: str) -> RewardInfo:
    """The evaluator's findings behind reward(); `.error` names why it is not correct."""


# name -> factory(overrides) -> Task, in registration order.
TaskFactory = Callable[[Mapping[str, Any]], Task]
_TASKS: dict[str, TaskFactory] = {}


def register_task(name: str):
  """Decorator registering `factory(overrides: dict) -> Task` under `name`.

  A task module in rl_jax/tasks/ registers its tasks at import; the package imports every
  task module (see rl_jax/tasks/__init__.py), so adding a task is adding one file.
  """
  def deco(factory: TaskFactory) -> TaskFactory:
    if name in _TASKS:
      raise ValueError(f"task {name!r} is already registered")
    _TASKS[name] = factory
    return factory
  return deco


def list_tasks() -> list[str]:
  return sorted(_TASKS)


def get_task(name: str, overrides: Mapping[str, Any] | None = None) -> Task:
  """The registered task `name`, built with optional config overrides.

  Unknown names raise ConfigError naming them and the valid tasks; unknown override keys
  raise the task config's ConfigError naming them.
  """
  if name not in _TASKS:
    raise ConfigError(f"unknown task {name!r}; valid tasks: {list_tasks()}")
  task = _TASKS[name](dict(overrides or {}))
  if not isinstance(task, Task):
    raise TypeError(f"task {name!r}: its factory returned {type(task).__name__}, which does not "
                    "implement the Task protocol (rl_jax.tasks.base.Task)")
  return task

