"""Parameters and optimizer state initialized on the mesh, each leaf written straight into its sharding."""
from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from rl_jax import sharding as sh
from rl_jax.models import ModelConfig, families


def init_params(model_cfg: ModelConfig, seed: int, mesh=None) -> tuple[Any, dict]:
  """(graphdef, params as a pure dict), params placed with their shardings when a mesh is given.

  Initialization runs as one jitted program that writes every parameter straight into
  its sharding: no host copy of the full model, and one compilation instead of one per
  parameter shape (eager init compiles a random-normal kernel per distinct shape).
  """
  graphdef, abstract = abstract_state(model_cfg)
  shardings = sh.param_shardings(abstract, mesh) if mesh is not None else None

  def init():
    return nnx.to_pure_dict(nnx.split(families.build_model(model_cfg, seed))[1])
  return graphdef, jax.jit(init, out_shardings=shardings)()


def abstract_state(model_cfg: ModelConfig):
  """(graphdef, abstract nnx.State) without allocating parameters."""
  model = families.abstract_model(model_cfg)
  return nnx.split(model)


def opt_state_shardings(optimizer, params, mesh):
  """Shardings of `optimizer.init(params)`: each leaf that mirrors a parameter (same path suffix
  and shape, e.g. AdamW's moments) sharded like that parameter, the rest (step counts) replicated.

  Left to jit, the moments come out replicated: `zeros_like(param)` does not depend on the
  param's values, so no sharding propagates to it, and every device would hold the full
  optimizer state (the planner's finding on the pod configs). `params` may be arrays or
  sharded ShapeDtypeStructs.
  """
  return mirror_shardings(jax.eval_shape(optimizer.init, params), params, sh.replicated(mesh))


def mirror_shardings(tree, params, default):
  """Per leaf of `tree`: the sharding of the param it mirrors (same path suffix and shape), else
  `default` (None keeps the leaf's own)."""
  by_path = {tuple(path): x for path, x in jax.tree_util.tree_flatten_with_path(params)[0]}

  def one(path, x):
    path = tuple(path)
    for i in range(len(path)):
      p = by_path.get(path[i:])
      if p is not None and p.shape == x.shape:
        return p.sharding
    return x.sharding if default is None else default
  return jax.tree_util.tree_map_with_path(one, tree)


def init_opt_state(optimizer, params, mesh):
  """Optimizer state laid out like the params it mirrors; scalars (step counts) replicated."""
  return jax.jit(optimizer.init, out_shardings=opt_state_shardings(optimizer, params, mesh))(params)
