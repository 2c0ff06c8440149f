"""The `task` config section and what it builds: the task, its tokenizer, file-backed prompts bound to it."""
from __future__ import annotations

import dataclasses
from typing import Any

from rl_jax.config_utils import ConfigError
from rl_jax.models import ModelConfig
from rl_jax.tasks import Task, get_task
from rl_jax.tasks.hf_tokenizer import HFTokenizer
from rl_jax.tasks.tokenizer import CharTokenizer


@dataclasses.dataclass(frozen=True)
class TaskConfig:
  name: str = "countdown_easy"
  overrides: dict = dataclasses.field(default_factory=dict)
  # The dataset task's files (comma-separated paths or globs; local, gs://, s3://): top-level
  # keys so a pod command line passes them as --config.task.train_files=... (docs/configs.md).
  train_files: str = ""
  eval_files: str = ""


def make_task(cfg: TaskConfig) -> Task:
  files = {k: v for k, v in (("train_files", cfg.train_files), ("eval_files", cfg.eval_files)) if v}
  if files and cfg.name != "dataset":
    raise ConfigError(f"config key 'task.{next(iter(files))}': only task.name='dataset' reads files "
                      f"(task.name is {cfg.name!r})")
  if cfg.name == "dataset":
    return get_task(cfg.name, {**(cfg.overrides or {}), **files})
  return get_task(cfg.name, cfg.overrides or None)


def bind_task(task: Task, tok: Any, max_prompt_len: int) -> None:
  """Tasks that read prompts from files (`bind`) load, render and filter them for this tokenizer."""
  if hasattr(task, "bind"):
    task.bind(tok, max_prompt_len)


def has_eval(task: Task) -> bool:
  """Whether `task` has eval problems: every generated task does; a dataset only with eval files."""
  return getattr(task, "has_eval", True)


def make_tokenizer(task: Task, model_cfg: ModelConfig) -> Any:
  """The task's own tokenizer directory (`tokenizer_path`, an HF fast tokenizer) or CharTokenizer."""
  path = getattr(task, "tokenizer_path", "")
  if path:
    tok = HFTokenizer.from_dir(path)
  else:
    tok = CharTokenizer()
  if model_cfg.vocab_size < tok.vocab_size:
    raise ConfigError(f"config key 'model.vocab_size': {model_cfg.vocab_size} is smaller than the "
                      f"tokenizer's vocabulary ({tok.vocab_size}) for task '{task.name}'")
  return tok
