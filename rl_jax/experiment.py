"""Shared plumbing of the SFT and RL jobs, in three parts: config sections -> dataclasses (`TaskConfig`,
`section`, `check_top_level`, `check_batch`); task and tokenizer construction; parameters and optimizer
state initialized on the mesh (`init_params`, `abstract_state`, `init_opt_state`, their shardings)."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import nnx

from rl_jax import sharding as sh
from rl_jax.config_utils import ConfigError, from_dict
from rl_jax.models import ModelConfig, families
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


def check_top_level(config: Any, allowed: set[str]) -> None:
  """Unknown top-level sections fail before any compute, naming the key."""
  keys = set(config.keys())
  unknown = sorted(keys - allowed)
  if unknown:
    raise ConfigError(f"unknown top-level config key(s) {unknown} for job "
                      f"'{config.get('job')}'; valid: {sorted(allowed)}")


def section(config: Any, name: str, cls: type) -> Any:
  return from_dict(cls, config.get(name, {}) if name in config else {}, prefix=name)


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


def init_params(model_cfg: ModelConfig, seed: int, mesh=None) -> tuple[Any, dict]:
  """(graphdef, params as a pure dict), params placed with their shardings when a mesh is given.

  Initialization runs as one jitted program that writes every parameter straight into
  its sharding: no host copy of the full model, and one compilation instead of one per
  parameter shape (eager init compiles a random-normal kernel per distinct shape).
  """
  graphdef, abstract = abstract_state(model_cfg)
  shardings = sh.param_shardings(abstract, mesh) if mesh is not None else None

  def init():
    return nnx.to_pure_dict(nnx.split(families.build_model(model_cfg, seed))[1])
  return graphdef, jax.jit(init, out_shardings=shardings)()


def abstract_state(model_cfg: ModelConfig):
  """(graphdef, abstract nnx.State) without allocating parameters."""
  model = families.abstract_model(model_cfg)
  return nnx.split(model)


def check_batch(value: int, key: str, mesh) -> None:
  d = sh.batch_divisor(mesh)
  if value % d:
    raise ConfigError(f"config key '{key}': {value} is not a multiple of the mesh's batch "
                      f"split {d} (data*fsdp*expert)")


def opt_state_shardings(optimizer, params, mesh):
  """Shardings of `optimizer.init(params)`: each leaf that mirrors a parameter (same path suffix
  and shape, e.g. AdamW's moments) sharded like that parameter, the rest (step counts) replicated.

  Left to jit, the moments come out replicated: `zeros_like(param)` does not depend on the
  param's values, so no sharding propagates to it, and every device would hold the full
  optimizer state (the planner's finding on the pod configs). `params` may be arrays or
  sharded ShapeDtypeStructs.
  """
  return mirror_shardings(jax.eval_shape(optimizer.init, params), params, sh.replicated(mesh))


def mirror_shardings(tree, params, default):
  """Per leaf of `tree`: the sharding of the param it mirrors (same path suffix and shape), else
  `default` (None keeps the leaf's own)."""
  by_path = {tuple(path): x for path, x in jax.tree_util.tree_flatten_with_path(params)[0]}

  def one(path, x):
    path = tuple(path)
    for i in range(len(path)):
      p = by_path.get(path[i:])
      if p is not None and p.shape == x.shape:
        return p.sharding
    return x.sharding if default is None else default
  return jax.tree_util.tree_map_with_path(one, tree)


def init_opt_state(optimizer, params, mesh):
  """Optimizer state laid out like the params it mirrors; scalars (step counts) replicated."""
  return jax.jit(optimizer.init, out_shardings=opt_state_shardings(optimizer, params, mesh))(params)
