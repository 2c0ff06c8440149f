"""Verifiable tasks for SFT / RL: the Task protocol, the registry, and every task module in this package."""
from __future__ import annotations

import importlib
import pkgutil

from rl_jax.tasks.base import RewardInfo, Task, get_task, list_tasks, register_task
from rl_jax.tasks.countdown import CountdownConfig, CountdownTask, Problem
from rl_jax.tasks.reward import RewardDetails

# Modules here that are not tasks (they hold shared code); every other module is a task
# module and is imported so that its register_task calls run: a new task is one new file.
_NOT_TASK_MODULES = frozenset({"base", "reward", "tokenizer", "hf_tokenizer", "records", "order", "verifiers",
                               "sandbox", "arith"})
for _m in pkgutil.iter_modules(__path__):
  if _m.name not in _NOT_TASK_MODULES and not _m.name.startswith("_"):
    importlib.import_module(f"{__name__}.{_m.name}")

__all__ = ["CountdownConfig", "CountdownTask", "Problem", "RewardDetails", "RewardInfo", "Task",
           "get_task", "list_tasks", "register_task"]
