"""The config sections of each job as their dataclasses: defaults, completion of config files, key lookup."""
from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any

# Values a `--config.a.b=v` flag can set (ml_collections overrides a key only with its type).
SCALAR = (bool, int, float, str)


def sections(job: str) -> dict[str, type]:
  """Section name -> dataclass of an 'rl' or 'sft' job (an RL config also carries its SFT warm
  start's `sft` / `sft_optim`). Imported here, not at module level: the jobs import this module."""
  from rl_jax import experiment as ex  # pylint: disable=g-import-not-at-top
  from rl_jax import sharding as sh  # pylint: disable=g-import-not-at-top
  from rl_jax.metrics import LoggingConfig  # pylint: disable=g-import-not-at-top
  from rl_jax.models import ModelConfig  # pylint: disable=g-import-not-at-top
  from rl_jax.optim import OptimConfig  # pylint: disable=g-import-not-at-top
  from rl_jax.sft import SFTConfig  # pylint: disable=g-import-not-at-top
  common = {"task": ex.TaskConfig, "model": ModelConfig, "mesh": sh.MeshConfig, "optim": OptimConfig,
            "logging": LoggingConfig}
  if job == "sft":
    return {**common, "sft": SFTConfig}
  from rl_jax.rl.job import RLConfig, WarmStartConfig  # pylint: disable=g-import-not-at-top
  from rl_jax.rl.loss_config import AdvantageConfig, LossConfig  # pylint: disable=g-import-not-at-top
  from rl_jax.sampler.config import SamplerConfig  # pylint: disable=g-import-not-at-top
  return {**common, "sampler": SamplerConfig, "loss": LossConfig, "advantage": AdvantageConfig,
          "rl": RLConfig, "warm_start": WarmStartConfig, "sft": SFTConfig, "sft_optim": OptimConfig}


def _scalar_defaults(cls: type) -> dict[str, Any]:
  hints = typing.get_type_hints(cls)
  out = {}
  for f in dataclasses.fields(cls):
    if f.default is not dataclasses.MISSING and isinstance(f.default, SCALAR):
      # A float field written with an int default (`tis_high: float = 2`) must take float flags.
      out[f.name] = float(f.default) if hints.get(f.name) is float else f.default
  # Fields registry entries own (methods' thresholds, estimators' constants), as registered now.
  for k, (t, default) in getattr(cls, "registry_fields", lambda: {})().items():
    if isinstance(default, SCALAR):
      out[k] = float(default) if t is float else default
  return out


def defaults(job: str) -> dict[str, Any]:
  """Flattened `section.key` -> default of every scalar field of the job's sections."""
  return {f"{name}.{k}": v for name, cls in sections(job).items() for k, v in _scalar_defaults(cls).items()}


def complete(config, job: str | None = None):
  """Adds every scalar schema key a section of `config` leaves out, at its default, so that every
  key is overridable from the command line (`--config.rl.meter_every=2`); returns `config`.

  Only sections the config has are completed, and a key the file sets (even to a preset name,
  as `sampler.quant`) is left alone.
  """
  job = job or config.get("job", "rl")
  for name, cls in sections(job).items():
    if name not in config:
      continue
    node = config[name]
    for k, v in _scalar_defaults(cls).items():
      if k not in node:
        node[k] = v
  return config


def closest_keys(key: str, job: str = "rl", n: int = 3) -> list[str]:
  """The schema keys nearest to a mistyped `section.key` (for an error message)."""
  return difflib.get_close_matches(key, sorted(defaults(job)), n=n, cutoff=0.6)
