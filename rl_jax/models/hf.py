"""Hugging Face checkpoints as rl_jax Transformers: generic sharded loading and streamed saving.

The file format itself (headers, sharded indexes, streamed writes) is `safetensors_io`; which HF
tensor feeds which parameter and the config.json mapping belong to each family (`models/families`).
"""
from __future__ import annotations

import dataclasses
import json
import os
import warnings
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from flax import nnx

from rl_jax.models import families
from rl_jax.models.config import EXECUTION_FIELDS as _EXECUTION_FIELDS
from rl_jax.models.config import ModelConfig
from rl_jax.models.safetensors_io import (DTYPE_TO_ST, INDEX_FILE, SINGLE_FILE,  # noqa: F401
                                          ST_TO_NP, CheckpointError, Reader, TensorRef,
                                          equal_tensors, index_tensors, norm_index, plan_shards,
                                          read_json, write_index, write_safetensors)
from rl_jax.models.families import TensorEntry
from rl_jax.models.transformer import Transformer
from rl_jax.sharding import state_shardings

SUPPORTED_MODEL_TYPES = tuple(families.MODEL_TYPES)

CONFIG_FILE = "config.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30

# --------------------------------------------------------------------------------------------------
# config.json <-> ModelConfig: each family's own mapping (rl_jax/models/families)


def _config_path(path: str) -> str:
  return path if path.endswith(".json") else os.path.join(path, CONFIG_FILE)


def hf_to_model_config(hf: Mapping[str, Any], *, where: str = CONFIG_FILE, dtype: str | None = None,
                       param_dtype: str | None = None, **overrides) -> ModelConfig:
  """Maps a `config.json` dict of a registered family (`families.MODEL_TYPES`) to ModelConfig.

  Args:
    hf: the parsed config.json.
    where: file name used in error messages.
    dtype / param_dtype: compute / storage dtype; default the checkpoint's own
      (`dtype` or `torch_dtype`; float16 becomes float32), param_dtype = dtype.
    **overrides: further ModelConfig fields (e.g. remat=True, router_aux_loss_coef=1e-3).
  """
  model_type = hf.get("model_type")
  if model_type not in families.MODEL_TYPES:
    raise CheckpointError(f"{where}: key 'model_type' = {model_type!r} is not supported; "
                          f"supported: {list(SUPPORTED_MODEL_TYPES)}")
  kw = families.MODEL_TYPES[model_type].config_kwargs(families.HfReader(hf, where))
  dtype = dtype or families.checkpoint_dtype(hf)
  kw.update(dtype=dtype, param_dtype=param_dtype or dtype)
  kw.update(overrides)
  try:
    return ModelConfig(**kw)
  except (ValueError, TypeError) as e:
    raise CheckpointError(f"{where}: config does not give a valid ModelConfig: {e}") from None


def load_hf_config(path: str, *, dtype: str | None = None, param_dtype: str | None = None,
                   **overrides) -> ModelConfig:
  """ModelConfig of a checkpoint directory (or a config.json path); see hf_to_model_config."""
  cfg_path = _config_path(path)
  return hf_to_model_config(read_json(cfg_path), where=cfg_path, dtype=dtype,
                            param_dtype=param_dtype, **overrides)


def model_config_to_hf(cfg: ModelConfig, *, dtype: str | None = None,
                       extra: Mapping[str, Any] | None = None) -> dict:
  """config.json for `cfg` (its family's mapping), readable by transformers 4.x and 5.x."""
  hf = families.of(cfg).to_hf(cfg, dtype or cfg.param_dtype)
  hf.update(extra or {})
  return hf


# --------------------------------------------------------------------------------------------------
# Parameter <-> HF tensor plan


def _stack_plan(plan: list[TensorEntry], cfg: ModelConfig) -> list[TensorEntry]:
  """The unrolled plan regrouped for the scanned layout: `layers.{i}.X` of each layer group
  becomes one 'stacked' entry `layer_groups.{g}.X` (see transformer.stack_layers)."""
  by_path = {e.path: e for e in plan}
  out = [e for e in plan if e.path[0] != "layers"]
  tail = out[1:]  # final norm (and untied head) stay after the layers, as in HF order
  out = out[:1]
  for g, (start, n, _) in enumerate(cfg.layer_groups):
    for e in plan:
      if e.path[:2] != ("layers", start):
        continue
      sub = [by_path[("layers", start + j) + e.path[2:]] for j in range(n)]
      out.append(TensorEntry(("layer_groups", g) + e.path[2:], "stacked",
                        tuple(name for x in sub for name in x.names), tuple(sub)))
  return out + tail


def _plan(cfg: ModelConfig) -> list[TensorEntry]:
  """All parameters in HF checkpoint order: the family's name plan, regrouped when scanned."""
  out = families.of(cfg).tensor_plan(cfg)
  return _stack_plan(out, cfg) if cfg.scan_layers else out


def _hf_shape(kind: str, shape: Sequence[int]) -> tuple[int, ...]:
  """Shape of each HF tensor of an entry whose rl_jax parameter has `shape`."""
  if kind == "plain":
    return tuple(shape)
  if kind == "transpose":
    return (shape[1], shape[0])
  return (shape[2], shape[1])  # one expert's [out, in]


def _fused_names(prefix: str) -> tuple[str, str]:
  return prefix + "mlp.experts.gate_up_proj", prefix + "mlp.experts.down_proj"


def _resolve(plan: list[TensorEntry], shapes: Mapping[tuple, tuple], refs: Mapping[str, TensorRef],
             cfg: ModelConfig, path: str) -> list[tuple[TensorEntry, str, tuple[TensorRef, ...]]]:
  """Matches the plan against the checkpoint's tensors, raising on any missing / extra / misshapen one.

  Returns (entry, read kind, refs) per parameter. MoE layers accept the hub's
  per-expert layout or transformers >= 5's in-memory fused layout
  (`experts.gate_up_proj` [E, 2F, D], `experts.down_proj` [E, D, F]).
  """
  used: set[str] = set()
  out = []

  def fname(ref):
    return os.path.basename(ref.file)

  def check(ref: TensorRef, expected: tuple, param_path: tuple):
    if ref.dtype not in ST_TO_NP:
      raise CheckpointError(f"tensor '{ref.name}' in file '{fname(ref)}' has dtype {ref.dtype}; "
                            f"supported: {sorted(ST_TO_NP)}")
    if tuple(ref.shape) != tuple(expected):
      raise CheckpointError(f"tensor '{ref.name}' in file '{fname(ref)}' has shape {list(ref.shape)}, "
                            f"but config.json implies {list(expected)} (parameter "
                            f"{'/'.join(map(str, param_path))})")

  def missing(name, param_path):
    raise CheckpointError(f"checkpoint {path}: missing tensor '{name}' (for parameter "
                          f"{'/'.join(map(str, param_path))}); files: "
                          f"{sorted({fname(r) for r in refs.values()})}")

  def resolve(entry: TensorEntry, shape: tuple):
    if entry.kind == "stacked":  # scanned layout: resolve each layer against its slice's shape
      return entry, "stacked", tuple(resolve(sub, shape[1:]) for sub in entry.layers)
    if entry.kind == "experts" and entry.names[0] not in refs:
      prefix = entry.names[0].split("mlp.experts.")[0]
      gate_up, down = _fused_names(prefix)
      e, f, d = cfg.n_experts, cfg.moe_d_ff, cfg.d_model
      if gate_up in refs or down in refs:
        ours = entry.path[-1]
        name, expected = (down, (e, d, f)) if ours == "w_down" else (gate_up, (e, 2 * f, d))
        if name not in refs:
          missing(name, entry.path)
        check(refs[name], expected, entry.path)
        used.add(name)
        kind = {"w_gate": "fused_gate", "w_up": "fused_up", "w_down": "fused_down"}[ours]
        return entry, kind, (refs[name],)
    expected = _hf_shape(entry.kind, shape)
    entry_refs = []
    for name in entry.names:
      if name not in refs:
        missing(name, entry.path)
      check(refs[name], expected, entry.path)
      used.add(name)
      entry_refs.append(refs[name])
    return entry, entry.kind, tuple(entry_refs)

  for entry in plan:
    out.append(resolve(entry, shapes[entry.path]))
  for name, ref in refs.items():
    if name in used:
      continue
    # A tied checkpoint may still carry the (identical) output matrix; old ones a RoPE buffer.
    if (name == "lm_head.weight" and cfg.tie_embeddings) or name.endswith("rotary_emb.inv_freq"):
      continue
    raise CheckpointError(f"unexpected tensor '{name}' in file '{fname(ref)}': not a parameter of "
                          f"this {families.of(cfg).hf_model_type(cfg)} config ({path})")
  return out


def _read_slice(reader: Reader, kind: str, refs: Sequence[TensorRef], index: tuple[slice, ...],
                f_dim: int) -> np.ndarray:
  """The rl_jax-layout block `param[index]`, reading only the bytes it needs.

  'stacked' (scanned layout): `refs` holds each layer's resolved (entry, kind, refs);
  only the layers in the block's leading slice are read.
  """
  if kind == "stacked":
    return np.stack([_read_slice(reader, sub_kind, sub_refs, index[1:], f_dim)
                     for _, sub_kind, sub_refs in refs[index[0]]])
  if kind == "plain":
    return reader.view(refs[0])[index]
  if kind == "transpose":
    s0, s1 = index
    return reader.view(refs[0])[s1, s0].T
  se, s1, s2 = index
  if kind == "experts":
    # Only this shard's experts are touched: host memory is the shard, not the layer.
    return np.stack([reader.view(refs[e])[s2, s1].T for e in range(se.start, se.stop)])
  v = reader.view(refs[0])
  if kind == "fused_gate":   # [E, 2F, D] rows [0, F) -> [E, D, F]
    return v[se, s2, s1].transpose(0, 2, 1)
  if kind == "fused_up":     # rows [F, 2F)
    return v[se, slice(s2.start + f_dim, s2.stop + f_dim), s1].transpose(0, 2, 1)
  if kind == "fused_down":   # [E, D, F] -> [E, F, D]
    return v[se, s2, s1].transpose(0, 2, 1)
  raise AssertionError(kind)


def _untie_if_head_differs(cfg: ModelConfig, refs: Mapping[str, TensorRef], reader: Reader,
                           path: str) -> ModelConfig:
  """`cfg` untied when a tied config comes with an `lm_head.weight` unequal to the embedding.

  transformers does the same (it refuses to tie, warns, and keeps the file's head):
  tying would silently replace the head the checkpoint was trained with.
  """
  head, emb = "lm_head.weight", "model.embed_tokens.weight"
  if not cfg.tie_embeddings or head not in refs or emb not in refs:
    return cfg
  a, b = refs[head], refs[emb]
  if a.dtype == b.dtype and a.shape == b.shape and equal_tensors(reader, a, b):
    return cfg
  warnings.warn(f"{path}: {CONFIG_FILE} says tie_word_embeddings=true, but tensor '{head}' "
                f"('{os.path.basename(a.file)}') differs from '{emb}' "
                f"('{os.path.basename(b.file)}'); loading them untied with the file's {head}, as "
                f"transformers does. Set tie_word_embeddings=false to silence this.",
                stacklevel=3)
  return dataclasses.replace(cfg, tie_embeddings=False)


def _state_paths(state) -> dict[tuple, Any]:
  return {tuple(p): v for p, v in nnx.to_flat_state(state)}


def load_hf_model(path: str, *, mesh: jax.sharding.Mesh | None = None, dtype: str | None = None,
                  param_dtype: str | None = None, **overrides) -> Transformer:
  """Builds a Transformer from a local HF checkpoint directory of a registered family.

  The model is created abstractly (`nnx.eval_shape`, no memory), then each
  parameter is made with `jax.make_array_from_callback` directly in its target
  sharding (`state_shardings`, from each Param's logical axes) when `mesh` is
  given, else on the default device. The callback reads only the block of the
  memory-mapped safetensors bytes that the device's shard needs.

  Peak host memory: the distinct blocks of ONE parameter that this host's
  devices hold (for an expert stack sharded over `expert`, only the local
  experts are read; a replicated parameter is read once), plus reclaimable
  page cache for the mapped bytes. It scales with the largest parameter's
  per-host share, not with the checkpoint size or the number of layers;
  without a mesh, with the largest single parameter (the embedding, or one
  layer's [E, D, F] expert stack).

  Args:
    path: directory with config.json and model.safetensors or sharded
      model-*.safetensors (+ model.safetensors.index.json).
    mesh: optional device mesh.
    dtype / param_dtype: compute / storage dtype (default: the checkpoint's).
    **overrides: further ModelConfig fields (remat, router_aux_loss_coef, scan_layers, ...);
      with scan_layers=True each device block of a stacked parameter reads only its layers.
  """
  cfg = load_hf_config(path, dtype=dtype, param_dtype=param_dtype, **overrides)
  refs = index_tensors(path)
  reader = Reader()
  cfg = _untie_if_head_differs(cfg, refs, reader, path)
  abstract = families.abstract_model(cfg)
  graphdef, state = nnx.split(abstract)
  variables = _state_paths(state)
  shapes = {p: tuple(v.get_value().shape) for p, v in variables.items()}
  plan = _plan(cfg)
  if set(e.path for e in plan) != set(variables):
    raise AssertionError(f"hf plan / model parameter mismatch: "
                         f"{set(e.path for e in plan) ^ set(variables)}")
  resolved = _resolve(plan, shapes, refs, cfg, path)
  shardings = _state_paths(state_shardings(state, mesh)) if mesh is not None else None
  default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  for entry, kind, refs in resolved:
    var = variables[entry.path]
    shape, np_dtype = shapes[entry.path], np.dtype(var.get_value().dtype)
    cache: dict[tuple, np.ndarray] = {}

    def block(index, kind=kind, refs=refs, shape=shape, np_dtype=np_dtype, cache=cache):
      idx = norm_index(index, shape)
      key = tuple((s.start, s.stop) for s in idx)
      if key not in cache:  # partially replicated params: one read per distinct block
        cache[key] = np.array(_read_slice(reader, kind, refs, idx, cfg.moe_d_ff), dtype=np_dtype)
      return cache[key]

    sharding = shardings[entry.path] if shardings is not None else default
    var.set_value(jax.make_array_from_callback(shape, sharding, block, dtype=np_dtype))
    cache.clear()
  return nnx.merge(graphdef, state)


# --------------------------------------------------------------------------------------------------
# Saving


def _to_host(x: jax.Array) -> np.ndarray:
  if getattr(x, "is_fully_addressable", True):
    return np.asarray(jax.device_get(x))
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def save_hf_checkpoint(model: Transformer, path: str, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                       dtype: str | None = None, extra_config: Mapping[str, Any] | None = None,
                       overwrite: bool = False, config: Mapping[str, Any] | None = None) -> list[str]:
  """Writes `model` as a HF checkpoint of its family (hub layout, per-expert MoE tensors).

  Files: config.json, model.safetensors or model-0000i-of-0000n.safetensors plus
  model.safetensors.index.json when the tensors exceed `max_shard_bytes`.
  Parameters are gathered to host one at a time and streamed into the files,
  so peak host memory is about the largest single parameter (one layer's
  expert stack, or the embedding), never a whole shard. On multi-host meshes
  every process must call this (the gathers are collective); process 0 writes.

  Args:
    model: the Transformer.
    path: output directory (created if needed).
    max_shard_bytes: largest file size; a tensor larger than that gets its own file.
    dtype: on-disk dtype ('float32' / 'bfloat16'); default cfg.param_dtype. Every
      tensor, the float32 router included, is written in it (as HF checkpoints are).
    extra_config: keys merged into config.json (e.g. bos/eos_token_id, max_position_embeddings).
    overwrite: replace existing safetensors files in `path` (else refuse).
    config: the whole config.json to write instead of the family's (rl_jax.export carries the
      source checkpoint's over); it must describe `model` (checked: it maps to the model's config).

  Returns:
    The written file names.
  """
  cfg: ModelConfig = model.cfg
  dtype = dtype or cfg.param_dtype
  if dtype not in DTYPE_TO_ST:
    raise ValueError(f"dtype must be one of {sorted(DTYPE_TO_ST)}, got {dtype!r}")
  if config is not None:
    hf_config = {**config, **(extra_config or {})}
    # A config.json that reads back as another architecture would load these tensors wrongly.
    mine = dataclasses.replace(cfg, dtype=dtype, param_dtype=dtype)
    theirs = hf_to_model_config(hf_config, dtype=dtype, **{f: getattr(cfg, f) for f in _EXECUTION_FIELDS
                                                           if f not in ("dtype", "param_dtype")})
    if theirs != mine:
      raise ValueError(f"config does not describe this model: it reads as {theirs}, the model is {mine}")
  else:
    hf_config = model_config_to_hf(cfg, dtype=dtype, extra=extra_config)
  st_dtype = DTYPE_TO_ST[dtype]
  np_dtype = ST_TO_NP[st_dtype]
  variables = _state_paths(nnx.state(model))
  plan = _plan(cfg)
  writer = jax.process_index() == 0
  if writer:
    os.makedirs(path, exist_ok=True)
    old = [f for f in os.listdir(path) if f.endswith(".safetensors") or f == INDEX_FILE]
    if old and not overwrite:
      raise FileExistsError(f"{path} already holds {sorted(old)}; pass overwrite=True to replace them")
    for f in old:
      os.remove(os.path.join(path, f))

  # (name, HF shape) in checkpoint order; a parameter's tensors are contiguous so
  # only one gathered parameter is alive at a time.
  # A scanned layer group's stacked parameter is gathered one layer at a time (layer j
  # below; None for an unstacked parameter), keeping the same host-memory bound.
  tensors, owner = [], {}
  for entry in plan:
    shape = tuple(variables[entry.path].get_value().shape)
    subs = entry.layers if entry.kind == "stacked" else (entry,)
    for j, sub in enumerate(subs):
      layer = j if entry.kind == "stacked" else None
      sub_shape = shape[1:] if layer is not None else shape
      for e, name in enumerate(sub.names):
        tensors.append((name, _hf_shape(sub.kind, sub_shape), st_dtype))
        owner[name] = (entry.path, layer, sub.kind, e)
  names, shards = plan_shards(tensors, max_shard_bytes)
  n = len(shards)

  current: dict[str, Any] = {"key": None, "array": None}

  def produce(name: str) -> np.ndarray:
    param_path, layer, kind, e = owner[name]
    if current["key"] != (param_path, layer):
      current["array"] = None  # release the previous parameter before gathering the next
      value = variables[param_path].get_value()
      value = value if layer is None else value[layer]
      current["array"] = _to_host(value).astype(np_dtype, copy=False)
      current["key"] = (param_path, layer)
    arr = current["array"]
    if kind == "plain":
      return arr
    if kind == "transpose":
      return arr.T
    return arr[e].T

  if writer:
    for fname, shard in zip(names, shards):
      write_safetensors(os.path.join(path, fname), shard, produce)
  else:  # still join every collective gather, in the same order
    for shard in shards:
      for name, _, _ in shard:
        produce(name)
  current["array"] = None
  if writer:
    if n > 1:
      write_index(path, names, shards)
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
      json.dump(hf_config, f, indent=2)
  written = names + ([INDEX_FILE] if n > 1 else []) + [CONFIG_FILE]
  return written


__all__ = ["CheckpointError", "SUPPORTED_MODEL_TYPES", "hf_to_model_config", "load_hf_config",
           "load_hf_model", "model_config_to_hf", "save_hf_checkpoint"]
