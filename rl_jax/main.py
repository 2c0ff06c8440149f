"""Entry point: python -m rl_jax.main --config=configs/x.py[:arg] --workdir=DIR [--config.a.b=v]."""
if __name__ == "__main__":  # before jax loads: XLA:CPU runs re-exec with tcmalloc / jemalloc preloaded
  from rl_jax import host_memory
  host_memory.reexec_tuned()

import sys  # pylint: disable=g-import-not-at-top,wrong-import-position

from absl import app, flags, logging  # pylint: disable=g-import-not-at-top,wrong-import-position
from ml_collections import config_flags

from rl_jax import artifacts
from rl_jax import cli
from rl_jax import distributed
from rl_jax import preempt
from rl_jax.config_utils import ConfigError
from rl_jax.workdir import LockHeldError

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and plots.")
flags.mark_flags_as_required(["config", "workdir"])

JOBS = ("sft", "rl")

# Exit codes: 0 done, 2 config error, 3 run error (a non-finite step), 75 preempted (rl_jax/artifacts.py).
CONFIG_ERROR, RUN_ERROR = artifacts.CONFIG_ERROR, artifacts.RUN_ERROR
# RL_JAX_TRACEBACK=1 prints the full traceback of an expected failure too (rl_jax/cli.py).
TRACEBACK_ENV = cli.TRACEBACK_ENV
_fail = cli.fail


def _parse_flags(argv):
  """absl's flag parsing, with a bad `--config.a.b=v` reported in one line naming the key and the
  schema's closest keys instead of ml_collections' chained traceback."""
  try:
    return flags.FLAGS(argv)
  except (flags.Error, AttributeError, KeyError, TypeError, ValueError) as e:
    bad = [a.split("=", 1)[0][len("--config."):] for a in argv[1:] if a.startswith("--config.")]
    unknown = [k for k in bad if not _known(k)]
    if unknown:
      from rl_jax import config_schema  # pylint: disable=g-import-not-at-top
      near = {k: config_schema.closest_keys(k) for k in unknown}
      _fail(CONFIG_ERROR, "config error: unknown config key(s) " + "; ".join(
          f"'{k}'" + (f" (closest: {', '.join(v)})" if v else "") for k, v in near.items()))
    _fail(CONFIG_ERROR, f"config error: {str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__}")


def _known(key: str) -> bool:
  from rl_jax import config_schema  # pylint: disable=g-import-not-at-top
  return key in config_schema.defaults("rl") or key in config_schema.defaults("sft") or "." not in key


def main(argv):
  del argv
  distributed.maybe_initialize()  # multi-process runs (launch/): must precede any JAX computation
  logging.set_verbosity(logging.WARNING)  # orbax logs every file operation at INFO
  config = _CONFIG.value
  try:
    job = config.get("job")
  except OSError as e:  # ml_collections defers a file's load error to the config's first use; errno line last
    path = config_flags.get_config_filename(flags.FLAGS["config"])
    _fail(CONFIG_ERROR, f"config error: --config={path}: {str(e).strip().splitlines()[-1].strip()}")
  if job not in JOBS:
    _fail(CONFIG_ERROR, f"config error: config key 'job': {job!r} is not one of {list(JOBS)}")
  try:
    if job == "sft":
      from rl_jax import sft  # pylint: disable=g-import-not-at-top
      sft.run(config, _WORKDIR.value)
    else:
      from rl_jax.rl import trainer  # pylint: disable=g-import-not-at-top
      trainer.run(config, _WORKDIR.value)
  except preempt.Preempted as e:
    print(f"[{job}] {e}", flush=True)
    sys.exit(preempt.PREEMPTED_EXIT_CODE)
  except (ConfigError, LockHeldError) as e:
    _fail(CONFIG_ERROR, f"config error: {e}")
  except FloatingPointError as e:
    _fail(RUN_ERROR, f"run error: {e}")


if __name__ == "__main__":
  app.run(main, flags_parser=_parse_flags)
