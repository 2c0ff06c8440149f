"""Config sections -> frozen dataclasses for every job: unknown top-level keys, one section, and the
batch-over-mesh check, each failing with the config key it names."""
from __future__ import annotations

from typing import Any

from rl_jax import sharding as sh
from rl_jax.config_utils import ConfigError, from_dict


def check_top_level(config: Any, allowed: set[str]) -> None:
  """Unknown top-level sections fail before any compute, naming the key."""
  keys = set(config.keys())
  unknown = sorted(keys - allowed)
  if unknown:
    raise ConfigError(f"unknown top-level config key(s) {unknown} for job "
                      f"'{config.get('job')}'; valid: {sorted(allowed)}")


def section(config: Any, name: str, cls: type) -> Any:
  """The `name` section as a frozen `cls` (defaults where absent); a bad key or value names `name.key`."""
  return from_dict(cls, config.get(name, {}) if name in config else {}, prefix=name)


def check_batch(value: int, key: str, mesh) -> None:
  """A batch size that the mesh's batch axes (data x fsdp x expert) split evenly, or the key named."""
  d = sh.batch_divisor(mesh)
  if value % d:
    raise ConfigError(f"config key '{key}': {value} is not a multiple of the mesh's batch "
                      f"split {d} (data*fsdp*expert)")
