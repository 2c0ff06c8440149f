"""quantize_params: a model's parameter tree -> sampler weights (QTensors for the weights tagged linear)."""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from rl_jax.config_utils import ConfigError
from rl_jax.models import families
from rl_jax.ops import quantized
from rl_jax.quant import formats as F
from rl_jax.quant.config import QuantConfig
from rl_jax.quant.qtensor import QTensor

# Tags (nnx.Param metadata) set where a parameter is created (models/layers.py `param(..., **tags)`):
# the model declares which of its weights are linear, so a family adding one adds its tag, not a
# name here. Embeddings, the router (routing is precision-sensitive), norm scales, biases and the
# shared-expert gate carry neither and are never quantized.
QUANTIZE_TAG = "quantize"   # a linear weight [in, out] / [experts, in, out]
LM_HEAD_TAG = "lm_head"     # the output projection [D, V]: quantized only with `quantize_lm_head`
ROLES = (QUANTIZE_TAG, LM_HEAD_TAG)
# The scanned layout's subtree (models/transformer.py): its weights carry one leading layer axis,
# which their `axes` tag names "layers".
STACKED_KEY = "layer_groups"
STACKED_AXIS = "layers"
# nnx.State paths end in the Variable's attribute, not the parameter's name.
_VARIABLE_ATTRS = frozenset({"value", "raw_value"})
# A name the models tag in one place and not in another: a tree without tags cannot be planned by it.
_AMBIGUOUS = "ambiguous"


def _key(k) -> Any:
  for attr in ("key", "name", "idx"):
    if hasattr(k, attr):
      return getattr(k, attr)
  return k


def _named_keys(path) -> tuple:
  return tuple(_key(k) for k in path
               if not (isinstance(k, jax.tree_util.GetAttrKey) and k.name in _VARIABLE_ATTRS))


def param_name(path) -> str | None:
  """The parameter's own name: the last string key of its path (None if there is none)."""
  keys = _named_keys(path)
  return keys[-1] if keys and isinstance(keys[-1], str) else None


def path_str(path) -> str:
  return "/".join(str(k) for k in _named_keys(path))


def stacked_axes(path) -> int:
  """Leading stacked-layer axes of the parameter at `path`: 1 under `layer_groups`, else 0."""
  return int(STACKED_KEY in _named_keys(path))


@dataclasses.dataclass(frozen=True)
class QuantPlan:
  """Which leaves of a parameter tree `quantize_params` replaces, read from the parameters' tags.

  `entries`: (path, role, stacked) per tagged leaf: its keys in the pure tree (`nnx.to_pure_dict`'s,
  the Variable's `.value` dropped), its tag (`QUANTIZE_TAG` or `LM_HEAD_TAG`) and its leading
  stacked-layer axes. Frozen and hashable: a static argument under jit. Built by `plan_of`.
  """
  entries: frozenset = frozenset()

  def table(self, lm_head: bool) -> dict[tuple, int]:
    """{path: stacked axes} of the leaves to quantize (the lm head only with `lm_head`)."""
    return {p: s for p, role, s in self.entries if role == QUANTIZE_TAG or (lm_head and role == LM_HEAD_TAG)}

  def paths(self, role: str) -> frozenset:
    """'/'-joined paths of the leaves tagged `role`."""
    return frozenset("/".join(map(str, p)) for p, r, _ in self.entries if r == role)


def _is_variable(x) -> bool:
  return isinstance(x, nnx.Variable)


def _role(meta: Mapping, where: str) -> str | None:
  roles = [r for r in ROLES if meta.get(r)]
  if len(roles) > 1:
    raise ValueError(f"parameter '{where}' carries the tags {roles}: at most one of {list(ROLES)}")
  return roles[0] if roles else None


def plan_of(tree: Any) -> QuantPlan:
  """The plan of an nnx.Module or a tree of its Variables (an nnx.State, e.g. of
  `families.abstract_model(cfg)`: nothing allocated), from the tags on its parameters.

  A stacked weight's layer axis is read from its `axes` tag (first axis "layers"), else from
  a `layer_groups` segment in its path. A tree with no Variable (a pure dict) has no tags:
  an error, since its plan would be empty.
  """
  if isinstance(tree, nnx.Module):
    tree = nnx.state(tree)
  flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_variable)[0]
  if not any(_is_variable(v) for _, v in flat):
    raise ValueError("plan_of needs the model's nnx.State (or the model): a pure tree carries no parameter "
                     "tags; build the plan from `nnx.state(families.abstract_model(cfg))`")
  entries = set()
  for path, var in flat:
    if not _is_variable(var):
      continue
    meta = var.get_metadata()
    role = _role(meta, path_str(path))
    if role is None:
      continue
    axes = meta.get("axes")
    stacked = int(tuple(axes)[:1] == (STACKED_AXIS,)) if axes is not None else stacked_axes(path)
    entries.add((_named_keys(path), role, stacked))
  return QuantPlan(frozenset(entries))


@functools.cache
def tagged_names() -> Mapping[str, str]:
  """{parameter name: tag} over every parameter the models can create, derived from their tags.

  For trees that carry no tags (pure dicts built by hand or by `nnx.to_pure_dict` without a
  plan): `quantize_params` matches their leaves by name against this. Read off
  `families.reference_configs()` (each family with every block switch on); a name tagged in one
  place and untagged in another maps to "ambiguous", and such a leaf needs a plan.
  """
  seen: dict[str, set] = {}
  for cfg in families.reference_configs():
    flat = jax.tree_util.tree_flatten_with_path(nnx.state(families.abstract_model(cfg), nnx.Param),
                                                is_leaf=_is_variable)[0]
    for path, var in flat:
      name = param_name(path)
      if name is not None:
        seen.setdefault(name, set()).add(_role(var.get_metadata(), path_str(path)))
  return {n: (next(iter(r)) if len(r) == 1 else _AMBIGUOUS) for n, r in seen.items() if r != {None}}


def __getattr__(name: str):
  # Kept for callers that filter pure trees by name; derived from the tags, never listed.
  if name == "QUANTIZED_NAMES":
    return frozenset(n for n, r in tagged_names().items() if r == QUANTIZE_TAG)
  if name == "LM_HEAD_NAME":
    (head,) = [n for n, r in tagged_names().items() if r == LM_HEAD_TAG]
    return head
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _plan_by_name(tree: Any) -> QuantPlan:
  names = tagged_names()
  entries = set()
  for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
    role = names.get(param_name(path))
    if role == _AMBIGUOUS:
      raise ValueError(f"parameter '{path_str(path)}': its name is tagged for quantization in one place of the "
                       "models and not in another, and this tree carries no tags: pass plan=plan_of(state)")
    if role is not None:
      entries.add((_named_keys(path), role, stacked_axes(path)))
  return QuantPlan(frozenset(entries))


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


def quantize_params(params: Any, qcfg: QuantConfig, plan: QuantPlan | None = None) -> Any:
  """Replaces the linear weights of `params` (nested dict or nnx.State) by QTensors.

  Which leaves: those `plan` lists (`plan_of(abstract state)`); without one, the tags on
  `params`' own Variables (an nnx.State), or, for a tree that carries no tags (a pure dict),
  the leaves whose names the models tag (`tagged_names`). Leaves tagged `quantize` (and
  `lm_head` with `quantize_lm_head`) are quantized with `qcfg.weights`, carrying
  `qcfg.activations` for W+A matmuls; with an fp32 / bf16 weight format they are only cast.
  Everything else passes through untouched. A scanned model's stacked weights (leading layer
  axis) get per-layer scales: each layer's slice equals the unrolled layer's QTensor.
  Shape checks use static shapes, so this is jittable
  (`jax.jit(quantize_params, static_argnums=(1, 2))`) and fails at trace time; a plan path
  missing from `params` (a plan of another model or layout) is a ValueError naming it.
  """
  if plan is None:
    has_tags = any(_is_variable(x) for x in jax.tree_util.tree_leaves(params, is_leaf=_is_variable))
    plan = plan_of(params) if has_tags else _plan_by_name(params)
  table = plan.table(qcfg.quantize_lm_head)
  seen = set()

  def one(path, leaf):
    keys = _named_keys(path)
    if keys not in table or leaf is None:
      return leaf
    seen.add(keys)
    if qcfg.weights.quantized:
      check_weight(path_str(path), tuple(leaf.shape), qcfg, table[keys])
    return quantized.quantize_weight(leaf, qcfg.weights, act=qcfg.activations, backend=qcfg.backend)

  out = jax.tree_util.tree_map_with_path(one, params)
  missing = sorted("/".join(map(str, p)) for p in table.keys() - seen)
  if missing:
    raise ValueError(f"quantization plan names {len(missing)} parameters this tree does not have "
                     f"(a plan of another model or layout?), e.g. {missing[:3]}")
  return out


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
