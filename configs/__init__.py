"""Experiment configs, one file per experiment (`get_config(arg)`); installed as `rl_jax.configs`."""
