"""Config file of one sweep run, `--config=configs/sweeps.py:SWEEP/NAME`; the sweeps are rl_jax/study/sweeps.py.

countdown_tiny with that run's overrides, for the runs flags cannot express (a whole
`sampler.quant` section in place of a preset name). `python -m rl_jax.configs.sweeps` prints the
sweeps' commands, as `python -m rl_jax.study.sweeps` does.
"""
import sys

from rl_jax.study import sweeps

get_config = sweeps.get_config

if __name__ == "__main__":
  sys.exit(sweeps.main())
