"""quantize_params: a model's parameter tree -> sampler weights (QTensors for the linear layers)."""
from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from rl_jax.config_utils import ConfigError
from rl_jax.quant import formats as F
from rl_jax.quant import ops
from rl_jax.quant.config import QuantConfig
from rl_jax.quant.qtensor import QTensor

# Linear weights, laid out [in, out] or [experts, in, out], with a leading stacked-layer axis
# under the scanned layout's `layer_groups`. Embeddings, the router (routing is
# precision-sensitive) and norm scales are never quantized.
QUANTIZED_NAMES = frozenset({"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"})
LM_HEAD_NAME = "w_unembed"
# The scanned layout's subtree (models/transformer.py): its weights carry one leading layer axis.
STACKED_KEY = "layer_groups"
# nnx.State paths end in the Variable's attribute, not the parameter's name.
_VARIABLE_ATTRS = frozenset({"value", "raw_value"})


def _key(k) -> Any:
  for attr in ("key", "name", "idx"):
    if hasattr(k, attr):
      return getattr(k, attr)
  return k


def _named_keys(path) -> list:
  return [_key(k) for k in path
          if not (isinstance(k, jax.tree_util.GetAttrKey) and k.name in _VARIABLE_ATTRS)]


def param_name(path) -> str | None:
  """The parameter's own name: the last string key of its path (None if there is none)."""
  keys = _named_keys(path)
  return keys[-1] if keys and isinstance(keys[-1], str) else None


def path_str(path) -> str:
  return "/".join(str(k) for k in _named_keys(path))


def stacked_axes(path) -> int:
  """Leading stacked-layer axes of the parameter at `path`: 1 under `layer_groups`, else 0."""
  return int(STACKED_KEY in _named_keys(path))


def check_weight(path: str, shape: tuple[int, ...], qcfg: QuantConfig, stacked: int | None = None) -> None:
  """Raises ConfigError naming the parameter when `qcfg` cannot quantize this shape.

  `stacked` leading axes (the scanned layout's layer axis) precede the per-layer
  `[in, out]` / `[experts, in, out]` shape; by default read off the '/'-joined `path`
  (1 when it has a `layer_groups` segment).
  """
  if stacked is None:
    stacked = int(STACKED_KEY in path.split("/"))
  if len(shape) - stacked not in (2, 3):
    lead = "[layers, " if stacked else "["
    raise ConfigError(f"parameter '{path}': quantized weights are {lead}in, out] or "
                      f"{lead}experts, in, out], got shape {tuple(shape)}")
  k = shape[-2]
  for role, spec in (("weights", qcfg.weights), ("activations", qcfg.activations)):
    if not spec.quantized:
      continue
    if spec.block is not None and k % spec.block:
      raise ConfigError(
          f"parameter '{path}' {tuple(shape)}: contraction dim {k} is not divisible by "
          f"sampler.quant.{role}.block_size={spec.block}")
    if F.get_format(spec.format).packed and k % 2:
      raise ConfigError(
          f"parameter '{path}' {tuple(shape)}: sampler.quant.{role}.format={spec.format} packs "
          f"two values per byte along the contraction dim, which must be even, got {k}")


def quantize_params(params: Any, qcfg: QuantConfig) -> Any:
  """Replaces the linear weights of `params` (nested dict or nnx.State) by QTensors.

  Leaves named in QUANTIZED_NAMES (and `w_unembed` with `quantize_lm_head`) are
  quantized with `qcfg.weights`, carrying `qcfg.activations` for W+A matmuls;
  with an fp32 / bf16 weight format they are only cast. Everything else passes
  through untouched. A scanned model's stacked weights (`layer_groups`, leading layer
  axis) get per-layer scales: each layer's slice equals the unrolled layer's QTensor.
  Shape checks use static shapes, so this is jittable
  (`jax.jit(quantize_params, static_argnums=1)`) and fails at trace time.
  """
  names = QUANTIZED_NAMES | ({LM_HEAD_NAME} if qcfg.quantize_lm_head else frozenset())

  def one(path, leaf):
    if param_name(path) not in names or leaf is None:
      return leaf
    if qcfg.weights.quantized:
      check_weight(path_str(path), tuple(leaf.shape), qcfg, stacked_axes(path))
    return ops.quantize_weight(leaf, qcfg.weights, act=qcfg.activations, backend=qcfg.backend)

  return jax.tree_util.tree_map_with_path(one, params)


def tree_nbytes(tree: Any) -> int:
  """Bytes stored by every array leaf of `tree` (concrete or abstract, e.g. from eval_shape)."""
  leaves = jax.tree_util.tree_leaves(tree)
  return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
             for x in leaves if hasattr(x, "shape") and hasattr(x, "dtype"))


def quantized_nbytes(tree: Any) -> tuple[int, int]:
  """(bytes of QTensor leaves incl. scales, logical element count of those QTensors)."""
  qts = [x for x in jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, QTensor))
         if isinstance(x, QTensor)]
  return sum(q.nbytes for q in qts), sum(q.size for q in qts)
