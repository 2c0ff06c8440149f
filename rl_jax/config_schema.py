"""The config sections of each job as their dataclasses: defaults, completion of config files, key lookup."""
from __future__ import annotations

import difflib
from typing import Any

from rl_jax.config_utils import SCALAR, flat_defaults, scalar_defaults  # noqa: F401  (SCALAR: public here too)


def sections(job: str) -> dict[str, type]:
  """Section name -> dataclass of an 'rl' or 'sft' job, as the job module declares them (an RL
  config also carries its SFT warm start's `sft` / `sft_optim`). Imported here, not at module
  level: an SFT job's schema does not import the RL stack."""
  if job == "sft":
    from rl_jax import sft  # pylint: disable=g-import-not-at-top
    return sft.sections()
  from rl_jax.rl import job as rl_job  # pylint: disable=g-import-not-at-top
  return rl_job.sections()


def defaults(job: str) -> dict[str, Any]:
  """Flattened `section.key` -> default of every scalar field of the job's sections."""
  return flat_defaults(sections(job))


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
    for k, v in scalar_defaults(cls).items():
      if k not in node:
        node[k] = v
  return config


def closest_keys(key: str, job: str = "rl", n: int = 3) -> list[str]:
  """The schema keys nearest to a mistyped `section.key` (for an error message)."""
  return difflib.get_close_matches(key, sorted(defaults(job)), n=n, cutoff=0.6)
