"""What to plan, without jax: the config file and its `--set` overrides, the mesh size, the program names."""
from __future__ import annotations

import ast
import importlib.util
import math
import os
from typing import Any

from rl_jax import cli


def load_config(spec: str):
  """`path.py[:arg]` -> the ConfigDict its `get_config(arg)` returns."""
  path, _, arg = spec.partition(":")
  if not os.path.isfile(path):
    raise SystemExit(f"--config: no file {path!r}")
  mod_spec = importlib.util.spec_from_file_location("_plan_config", path)
  if mod_spec is None:  # no loader for the suffix
    raise SystemExit(f"--config: {path!r} is not a Python config file (configs/X.py[:arg])")
  mod = importlib.util.module_from_spec(mod_spec)
  mod_spec.loader.exec_module(mod)
  if not hasattr(mod, "get_config"):
    raise SystemExit(f"--config: {path!r} defines no get_config(arg)")
  try:
    return mod.get_config(arg or None)
  except (ValueError, KeyError) as e:  # the file's own check of its `:arg` (configs/sweeps.py: KeyError)
    raise SystemExit(f"--config={spec}: {e.args[0] if e.args else type(e).__name__}") from e


def mesh_size(mesh_section: Any, devices: int) -> int:
  """Devices the config's mesh needs; an axis of -1 takes `devices` (or `mesh.num_devices`)."""
  sizes = [int(mesh_section.get(a, 1)) for a in ("data", "fsdp", "expert", "tensor")]
  if -1 not in sizes:
    return math.prod(sizes)
  n = int(mesh_section.get("num_devices", 0)) or devices
  return n


PROGRAMS = ("sync", "generate", "old_forward", "update", "first_order", "eval_greedy", "eval_sampled")


def default_programs(job) -> tuple[str, ...]:
  """The programs of PROGRAMS that `job`'s trainer runs: no separate p_old forward where the update
  computes p_old itself (`RLJob.old_in_update`: p_old 'latest', one mini-batch), no evaluation at
  `rl.eval_size=0`. `--programs` names any subset, these included."""
  skip = {"old_forward"} if job.old_in_update() else set()
  if not job.rl.eval_size:
    skip |= {"eval_greedy", "eval_sampled"}
  return tuple(p for p in PROGRAMS if p not in skip)


# The programs of the sampler's device group under async RL (`mesh.sampler_devices`).
SAMPLER_PROGRAMS = ("sync", "generate")


def set_key(config, item: str) -> None:
  """Applies one `--set a.b=value` override to a config section (value a Python literal, else a string)."""
  key, eq, raw = item.partition("=")
  if not eq or not key:
    raise SystemExit(f"--set {item!r}: expected KEY=VALUE")
  *parents, leaf = key.split(".")
  node = config
  for i, name in enumerate(parents):
    if name not in node:
      raise SystemExit(f"--set {item!r}: the config has no section {name!r}")
    node = node[name]
    if not hasattr(node, "keys"):  # `in` on a str value would test substrings
      raise SystemExit(f"--set {item!r}: {'.'.join(parents[:i + 1])!r} is a value, not a section")
  if hasattr(node.get(leaf), "keys"):
    raise SystemExit(f"--set {item!r}: {key!r} is a section; set one of its keys")
  if leaf not in node and cli.schema_has(key) is False:
    raise SystemExit(f"--set {item!r}: {cli.unknown_key(key)}")
  # A key the section lacks but the schema has is added (e.g. a ModelConfig field left at its
  # default); outside the schema's sections the job's own validation (RLJob.from_config) judges.
  try:
    value = ast.literal_eval(raw)
  except (ValueError, SyntaxError):
    value = raw
  node[leaf] = value
