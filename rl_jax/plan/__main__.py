"""`python -m rl_jax.plan`: the planner's command line (rl_jax.plan.cli)."""
import sys

from rl_jax.plan import cli

sys.exit(cli.main())
