"""Entry point: python -m rl_jax.main --config=configs/x.py[:arg] --workdir=DIR [--config.a.b=v]."""
if __name__ == "__main__":  # before jax loads: XLA:CPU runs re-exec with tcmalloc / jemalloc preloaded
  from rl_jax import host_memory
  host_memory.reexec_tuned()

import sys  # pylint: disable=g-import-not-at-top,wrong-import-position

from absl import app, flags, logging  # pylint: disable=g-import-not-at-top,wrong-import-position
from ml_collections import config_flags

from rl_jax import distributed
from rl_jax import preempt

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and plots.")
flags.mark_flags_as_required(["config", "workdir"])

JOBS = ("sft", "rl")


def main(argv):
  del argv
  distributed.maybe_initialize()  # multi-process runs (launch/): must precede any JAX computation
  logging.set_verbosity(logging.WARNING)  # orbax logs every file operation at INFO
  config = _CONFIG.value
  job = config.get("job")
  if job not in JOBS:
    raise app.UsageError(f"config key 'job': {job!r} is not one of {list(JOBS)}")
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


if __name__ == "__main__":
  app.run(main)
