"""Config file for study runs: `--config=rl_jax/study/config.py:STUDY/RUN` or `:warm_start/STUDY`.

Used where flags cannot express a run's overrides (ml_collections only overrides keys the
base file has, with values of their type: a quantization section in place of a preset name
needs this file), and for the one SFT warm start a study's runs share.
"""
from __future__ import annotations

import importlib.util
import os

import ml_collections

from rl_jax.study import studies
from rl_jax.study import sweeps

# The directory holding the `rl_jax` package: a source checkout (configs/ beside rl_jax/), or
# site-packages when installed (setup.py ships configs/ as rl_jax/configs), so base configs and
# launches resolve either way (`config_file`).
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def config_file(base: str) -> str:
  """`path[:arg]` as `--config` takes it from REPO_ROOT: `configs/X.py` names the checkout's file,
  or, installed (no configs/ beside rl_jax/), the same file under rl_jax/configs/."""
  path, sep, arg = base.partition(":")
  head, _, rest = path.partition("/")
  if head == "configs" and not os.path.isdir(os.path.join(REPO_ROOT, "configs")):
    path = os.path.join("rl_jax", "configs", rest)
  return path + sep + arg


def load_base(base: str) -> ml_collections.ConfigDict:
  """`path[:arg]` (relative to the repository root, as `--config` takes it) -> its get_config(arg)."""
  path, _, arg = config_file(base).partition(":")
  full = path if os.path.isabs(path) else os.path.join(REPO_ROOT, path)
  if not os.path.exists(full):
    raise FileNotFoundError(f"study base config {base!r}: no file {full}")
  spec = importlib.util.spec_from_file_location(f"_study_base_{abs(hash(full))}", full)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg) if arg else module.get_config()


def run_config(study_name: str, run_name: str) -> ml_collections.ConfigDict:
  study = studies.get(study_name)
  runs = {r.name: r for r in study.runs()}
  if run_name not in runs:
    raise KeyError(f"study {study_name!r} has no run {run_name!r}; runs: {sorted(runs)}")
  return sweeps.apply_overrides(load_base(study.base), runs[run_name].overrides)


def warm_start_config(study_name: str) -> ml_collections.ConfigDict:
  """The SFT job that the RL trainer's 'auto' warm start would run for this study's base config.

  Built by the trainer's own `warm_start.sft_config` so that the shared checkpoint is exactly
  the one each run would otherwise produce (same task, model, SFT section and steps).
  """
  from rl_jax.rl import warm_start  # pylint: disable=g-import-not-at-top
  return warm_start.sft_config(load_base(studies.get(study_name).base))


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  head, sep, tail = (arg or "").partition("/")
  if not sep:
    raise ValueError(f"config arg {arg!r}: expected 'STUDY/RUN' or 'warm_start/STUDY'; "
                     f"studies: {sorted(studies.STUDIES)}")
  if head == "warm_start":
    return warm_start_config(tail)
  return run_config(head, tail)
