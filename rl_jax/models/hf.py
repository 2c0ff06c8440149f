"""Load / save Hugging Face Qwen3 and Qwen3-MoE safetensors checkpoints as rl_jax Transformers."""
from __future__ import annotations

import dataclasses
import json
import os
import struct
from typing import Any, Mapping, Sequence

import jax
import ml_dtypes
import numpy as np
from flax import nnx

from rl_jax.models.config import ModelConfig
from rl_jax.models.transformer import Transformer
from rl_jax.sharding import state_shardings

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
# transformers' PretrainedConfig default when a config has no RoPE keys at all.
_HF_DEFAULT_ROPE_THETA = 10_000.0

# safetensors dtype tag <-> numpy dtype (little endian on disk). numpy has no
# bfloat16, so raw bytes are viewed through ml_dtypes rather than going via torch.
_ST_TO_NP = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
}
_DTYPE_TO_ST = {"float32": "F32", "bfloat16": "BF16"}


class CheckpointError(ValueError):
  """A checkpoint does not match what rl_jax expects; the message names the tensor / key and file."""


# --------------------------------------------------------------------------------------------------
# config.json <-> ModelConfig


def _read_json(path: str) -> dict:
  try:
    with open(path) as f:
      return json.load(f)
  except FileNotFoundError:
    raise CheckpointError(f"{path}: file not found") from None
  except json.JSONDecodeError as e:
    raise CheckpointError(f"{path}: invalid JSON ({e})") from None


def _config_path(path: str) -> str:
  return path if path.endswith(".json") else os.path.join(path, CONFIG_FILE)


def _rope_theta(hf: Mapping[str, Any], where: str) -> float:
  """rope_theta across transformers versions: `rope_parameters` (>= 5) or top-level (4.x)."""
  for key in ("rope_parameters", "rope_scaling"):
    params = hf.get(key)
    if params is None:
      continue
    if not isinstance(params, Mapping):
      raise CheckpointError(f"{where}: key '{key}' must be a mapping or null, got {params!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
      raise CheckpointError(f"{where}: key '{key}' has rope_type {rope_type!r}; only the default "
                            "(unscaled) RoPE of Qwen3 is implemented")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
      raise CheckpointError(f"{where}: key '{key}.partial_rotary_factor' != 1 is not supported")
    if "rope_theta" in params:
      return float(params["rope_theta"])
  return float(hf.get("rope_theta", _HF_DEFAULT_ROPE_THETA))


def _checkpoint_dtype(hf: Mapping[str, Any]) -> str:
  """ModelConfig dtype for a checkpoint's declared dtype (float16 -> float32: lossless)."""
  name = hf.get("dtype", hf.get("torch_dtype")) or "float32"
  name = str(name).replace("torch.", "")
  return "bfloat16" if name == "bfloat16" else "float32"


def hf_to_model_config(hf: Mapping[str, Any], *, where: str = CONFIG_FILE, dtype: str | None = None,
                       param_dtype: str | None = None, **overrides) -> ModelConfig:
  """Maps a Qwen3 / Qwen3-MoE `config.json` dict to ModelConfig.

  Args:
    hf: the parsed config.json.
    where: file name used in error messages.
    dtype / param_dtype: compute / storage dtype; default the checkpoint's own
      (`dtype` or `torch_dtype`; float16 becomes float32), param_dtype = dtype.
    **overrides: further ModelConfig fields (e.g. remat=True, router_aux_loss_coef=1e-3).
  """
  model_type = hf.get("model_type")
  if model_type not in SUPPORTED_MODEL_TYPES:
    raise CheckpointError(f"{where}: key 'model_type' = {model_type!r} is not supported; "
                          f"supported: {list(SUPPORTED_MODEL_TYPES)}")

  def need(key):
    if hf.get(key) is None:
      raise CheckpointError(f"{where}: required key '{key}' is missing (model_type {model_type!r})")
    return hf[key]

  if hf.get("hidden_act", "silu") != "silu":
    raise CheckpointError(f"{where}: key 'hidden_act' = {hf['hidden_act']!r}; only 'silu' is supported")
  if hf.get("attention_bias", False):
    raise CheckpointError(f"{where}: key 'attention_bias' = true is not supported (Qwen3 has none)")
  if hf.get("use_sliding_window", False):
    raise CheckpointError(f"{where}: key 'use_sliding_window' = true is not supported")
  n_heads = int(need("num_attention_heads"))
  d_model = int(need("hidden_size"))
  kw = dict(
      vocab_size=int(need("vocab_size")),
      d_model=d_model,
      n_layers=int(need("num_hidden_layers")),
      n_heads=n_heads,
      n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
      head_dim=int(hf.get("head_dim") or d_model // n_heads),
      d_ff=int(need("intermediate_size")),
      rope_theta=_rope_theta(hf, where),
      rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
      # Both Qwen3 config classes default to untied embeddings.
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      init_std=float(hf.get("initializer_range", 0.02)),
  )
  if model_type == "qwen3_moe":
    # transformers >= 5 writes num_local_experts (num_experts is an attribute alias).
    n_experts = hf.get("num_experts", hf.get("num_local_experts"))
    if n_experts is None:
      raise CheckpointError(f"{where}: required key 'num_experts' (or 'num_local_experts') is missing")
    kw.update(
        n_experts=int(n_experts),
        n_experts_per_tok=int(need("num_experts_per_tok")),
        moe_d_ff=int(hf.get("moe_intermediate_size", 768)),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        decoder_sparse_step=int(hf.get("decoder_sparse_step", 1)),
        mlp_only_layers=tuple(int(i) for i in (hf.get("mlp_only_layers") or ())),
    )
  dtype = dtype or _checkpoint_dtype(hf)
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
  return hf_to_model_config(_read_json(cfg_path), where=cfg_path, dtype=dtype,
                            param_dtype=param_dtype, **overrides)


def model_config_to_hf(cfg: ModelConfig, *, dtype: str | None = None,
                       extra: Mapping[str, Any] | None = None) -> dict:
  """config.json for `cfg` readable by transformers 4.51+ and 5.x (both RoPE spellings)."""
  moe = cfg.n_experts > 0
  hf = {
      "architectures": ["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"],
      "model_type": "qwen3_moe" if moe else "qwen3",
      "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.d_model,
      "intermediate_size": cfg.d_ff,
      "num_hidden_layers": cfg.n_layers,
      "num_attention_heads": cfg.n_heads,
      "num_key_value_heads": cfg.n_kv_heads,
      "head_dim": cfg.head_dim,
      "hidden_act": "silu",
      "attention_bias": False,
      "attention_dropout": 0.0,
      "max_position_embeddings": 40960,
      "rms_norm_eps": cfg.rms_eps,
      "rope_theta": cfg.rope_theta,
      "rope_scaling": None,
      "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
      "tie_word_embeddings": cfg.tie_embeddings,
      "initializer_range": cfg.init_std,
      "use_sliding_window": False,
      "sliding_window": None,
      "use_cache": True,
      "torch_dtype": dtype or cfg.param_dtype,
  }
  if moe:
    hf.update(
        num_experts=cfg.n_experts,
        num_experts_per_tok=cfg.n_experts_per_tok,
        moe_intermediate_size=cfg.moe_d_ff,
        norm_topk_prob=cfg.norm_topk_prob,
        decoder_sparse_step=cfg.decoder_sparse_step,
        mlp_only_layers=list(cfg.mlp_only_layers),
        router_aux_loss_coef=cfg.router_aux_loss_coef,
        output_router_logits=False,
    )
  hf.update(extra or {})
  return hf


# --------------------------------------------------------------------------------------------------
# Parameter <-> HF tensor plan


@dataclasses.dataclass(frozen=True)
class _Entry:
  """One rl_jax parameter and the HF tensor(s) it comes from.

  kind: 'plain' (same layout), 'transpose' (HF Linear [out, in] -> [in, out]) or
  'experts' (per-expert [out, in] tensors -> stacked [E, in, out]).
  """
  path: tuple
  kind: str
  names: tuple[str, ...]


def _plan(cfg: ModelConfig) -> list[_Entry]:
  """All parameters in HF checkpoint order; the one place the name mapping lives."""
  out = [_Entry(("embedding",), "plain", ("model.embed_tokens.weight",))]
  moe = set(cfg.moe_layers)
  for i in range(cfg.n_layers):
    p = f"model.layers.{i}."
    L = ("layers", i)
    out.append(_Entry(L + ("attn_norm", "scale"), "plain", (p + "input_layernorm.weight",)))
    for ours, theirs in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj")):
      out.append(_Entry(L + ("attn", ours), "transpose", (f"{p}self_attn.{theirs}.weight",)))
    out.append(_Entry(L + ("attn", "q_norm", "scale"), "plain", (p + "self_attn.q_norm.weight",)))
    out.append(_Entry(L + ("attn", "k_norm", "scale"), "plain", (p + "self_attn.k_norm.weight",)))
    out.append(_Entry(L + ("ffn_norm", "scale"), "plain", (p + "post_attention_layernorm.weight",)))
    projections = (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj"))
    if i in moe:
      out.append(_Entry(L + ("ffn", "w_router"), "transpose", (p + "mlp.gate.weight",)))
      for ours, theirs in projections:
        names = tuple(f"{p}mlp.experts.{e}.{theirs}.weight" for e in range(cfg.n_experts))
        out.append(_Entry(L + ("ffn", ours), "experts", names))
    else:
      for ours, theirs in projections:
        out.append(_Entry(L + ("ffn", ours), "transpose", (f"{p}mlp.{theirs}.weight",)))
  out.append(_Entry(("final_norm", "scale"), "plain", ("model.norm.weight",)))
  if not cfg.tie_embeddings:
    out.append(_Entry(("w_unembed",), "transpose", ("lm_head.weight",)))
  return out


def _hf_shape(kind: str, shape: Sequence[int]) -> tuple[int, ...]:
  """Shape of each HF tensor of an entry whose rl_jax parameter has `shape`."""
  if kind == "plain":
    return tuple(shape)
  if kind == "transpose":
    return (shape[1], shape[0])
  return (shape[2], shape[1])  # one expert's [out, in]


# --------------------------------------------------------------------------------------------------
# safetensors reading (header parse + memory map: nothing is read before it is sliced)


@dataclasses.dataclass(frozen=True)
class _TensorRef:
  file: str
  name: str
  dtype: str            # safetensors tag, e.g. "BF16"
  shape: tuple[int, ...]
  begin: int            # absolute byte offset in the file
  end: int


def _read_header(file: str) -> dict[str, _TensorRef]:
  try:
    with open(file, "rb") as f:
      (n,) = struct.unpack("<Q", f.read(8))
      header = json.loads(f.read(n))
  except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
    raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from None
  base = 8 + n
  refs = {}
  for name, info in header.items():
    if name == "__metadata__":
      continue
    b, e = info["data_offsets"]
    refs[name] = _TensorRef(file, name, info["dtype"], tuple(info["shape"]), base + b, base + e)
  return refs


class _Reader:
  """Memory-maps each file once; `view(ref)` is a lazy numpy view of one tensor."""

  def __init__(self):
    self._maps: dict[str, np.memmap] = {}

  def view(self, ref: _TensorRef) -> np.ndarray:
    mm = self._maps.get(ref.file)
    if mm is None:
      mm = self._maps[ref.file] = np.memmap(ref.file, dtype=np.uint8, mode="r")
    dt = _ST_TO_NP[ref.dtype]
    return mm[ref.begin:ref.end].view(dt).reshape(ref.shape)


def _index_tensors(path: str) -> dict[str, _TensorRef]:
  """name -> _TensorRef over all safetensors files of a checkpoint directory."""
  index_path = os.path.join(path, INDEX_FILE)
  refs: dict[str, _TensorRef] = {}
  if os.path.exists(index_path):
    weight_map = _read_json(index_path).get("weight_map")
    if not isinstance(weight_map, Mapping):
      raise CheckpointError(f"{index_path}: key 'weight_map' is missing or not a mapping")
    headers: dict[str, dict[str, _TensorRef]] = {}
    for name, fname in weight_map.items():
      file = os.path.join(path, fname)
      if fname not in headers:
        if not os.path.exists(file):
          raise CheckpointError(f"{index_path}: tensor '{name}' maps to file '{fname}', which does not exist")
        headers[fname] = _read_header(file)
      if name not in headers[fname]:
        raise CheckpointError(f"{index_path}: tensor '{name}' maps to file '{fname}', "
                              "which does not contain it")
      refs[name] = headers[fname][name]
    # Tensors present in a shard but absent from the index would be silently dropped.
    for fname, header in headers.items():
      for name in header:
        if name not in weight_map:
          raise CheckpointError(f"unexpected tensor '{name}' in file '{fname}': not listed in {INDEX_FILE}")
    return refs
  files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors")) if os.path.isdir(path) else []
  if not files:
    raise CheckpointError(f"{path}: no {INDEX_FILE} and no *.safetensors files")
  for fname in files:
    for name, ref in _read_header(os.path.join(path, fname)).items():
      if name in refs:
        raise CheckpointError(f"tensor '{name}' appears in both '{os.path.basename(refs[name].file)}' "
                              f"and '{fname}'")
      refs[name] = ref
  return refs


def _fused_names(prefix: str) -> tuple[str, str]:
  return prefix + "mlp.experts.gate_up_proj", prefix + "mlp.experts.down_proj"


def _resolve(plan: list[_Entry], shapes: Mapping[tuple, tuple], refs: Mapping[str, _TensorRef],
             cfg: ModelConfig, path: str) -> list[tuple[_Entry, str, tuple[_TensorRef, ...]]]:
  """Matches the plan against the checkpoint's tensors, raising on any missing / extra / misshapen one.

  Returns (entry, read kind, refs) per parameter. MoE layers accept the hub's
  per-expert layout or transformers >= 5's in-memory fused layout
  (`experts.gate_up_proj` [E, 2F, D], `experts.down_proj` [E, D, F]).
  """
  used: set[str] = set()
  out = []

  def fname(ref):
    return os.path.basename(ref.file)

  def check(ref: _TensorRef, expected: tuple, param_path: tuple):
    if ref.dtype not in _ST_TO_NP:
      raise CheckpointError(f"tensor '{ref.name}' in file '{fname(ref)}' has dtype {ref.dtype}; "
                            f"supported: {sorted(_ST_TO_NP)}")
    if tuple(ref.shape) != tuple(expected):
      raise CheckpointError(f"tensor '{ref.name}' in file '{fname(ref)}' has shape {list(ref.shape)}, "
                            f"but config.json implies {list(expected)} (parameter "
                            f"{'/'.join(map(str, param_path))})")

  def missing(name, param_path):
    raise CheckpointError(f"checkpoint {path}: missing tensor '{name}' (for parameter "
                          f"{'/'.join(map(str, param_path))}); files: "
                          f"{sorted({fname(r) for r in refs.values()})}")

  for entry in plan:
    shape = shapes[entry.path]
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
        out.append((entry, kind, (refs[name],)))
        continue
    expected = _hf_shape(entry.kind, shape)
    entry_refs = []
    for name in entry.names:
      if name not in refs:
        missing(name, entry.path)
      check(refs[name], expected, entry.path)
      used.add(name)
      entry_refs.append(refs[name])
    out.append((entry, entry.kind, tuple(entry_refs)))
  for name, ref in refs.items():
    if name in used:
      continue
    # A tied checkpoint may still carry the (identical) output matrix; old ones a RoPE buffer.
    if (name == "lm_head.weight" and cfg.tie_embeddings) or name.endswith("rotary_emb.inv_freq"):
      continue
    raise CheckpointError(f"unexpected tensor '{name}' in file '{fname(ref)}': not a parameter of "
                          f"this {'qwen3_moe' if cfg.n_experts else 'qwen3'} config ({path})")
  return out


def _norm_index(index, shape) -> tuple[slice, ...]:
  if index is None:
    index = ()
  index = tuple(index) + (slice(None),) * (len(shape) - len(tuple(index)))
  out = []
  for s, n in zip(index, shape):
    start, stop, step = s.indices(n)
    if step != 1:
      raise ValueError(f"strided shard index {s} not supported")
    out.append(slice(start, stop))
  return tuple(out)


def _read_slice(reader: _Reader, kind: str, refs: Sequence[_TensorRef], index: tuple[slice, ...],
                f_dim: int) -> np.ndarray:
  """The rl_jax-layout block `param[index]`, reading only the bytes it needs."""
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


def _state_paths(state) -> dict[tuple, Any]:
  return {tuple(p): v for p, v in nnx.to_flat_state(state)}


def load_hf_model(path: str, *, mesh: jax.sharding.Mesh | None = None, dtype: str | None = None,
                  param_dtype: str | None = None, **overrides) -> Transformer:
  """Builds a Transformer from a local HF Qwen3 / Qwen3-MoE checkpoint directory.

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
    **overrides: further ModelConfig fields (remat, router_aux_loss_coef, ...).
  """
  cfg = load_hf_config(path, dtype=dtype, param_dtype=param_dtype, **overrides)
  abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  variables = _state_paths(state)
  shapes = {p: tuple(v.get_value().shape) for p, v in variables.items()}
  plan = _plan(cfg)
  if set(e.path for e in plan) != set(variables):
    raise AssertionError(f"hf plan / model parameter mismatch: "
                         f"{set(e.path for e in plan) ^ set(variables)}")
  resolved = _resolve(plan, shapes, _index_tensors(path), cfg, path)
  shardings = _state_paths(state_shardings(state, mesh)) if mesh is not None else None
  default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  reader = _Reader()
  for entry, kind, refs in resolved:
    var = variables[entry.path]
    shape, np_dtype = shapes[entry.path], np.dtype(var.get_value().dtype)
    cache: dict[tuple, np.ndarray] = {}

    def block(index, kind=kind, refs=refs, shape=shape, np_dtype=np_dtype, cache=cache):
      idx = _norm_index(index, shape)
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


def _write_safetensors(file: str, tensors: list[tuple[str, tuple, str]], produce) -> None:
  """Streams one safetensors file: the header from shapes, then each tensor's bytes in turn."""
  header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
  offset = 0
  for name, shape, st_dtype in tensors:
    nbytes = int(np.prod(shape, dtype=np.int64)) * _ST_TO_NP[st_dtype].itemsize
    header[name] = {"dtype": st_dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
    offset += nbytes
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)  # 8-byte aligned data start, as the reference writer does
  with open(file, "wb") as f:
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)
    for name, shape, st_dtype in tensors:
      arr = produce(name)
      assert arr.shape == tuple(shape) and arr.dtype == _ST_TO_NP[st_dtype], (name, arr.shape, arr.dtype)
      f.write(np.ascontiguousarray(arr).tobytes())


def save_hf_checkpoint(model: Transformer, path: str, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                       dtype: str | None = None, extra_config: Mapping[str, Any] | None = None,
                       overwrite: bool = False) -> list[str]:
  """Writes `model` as a HF Qwen3 / Qwen3-MoE checkpoint (hub layout, per-expert MoE tensors).

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

  Returns:
    The written file names.
  """
  cfg: ModelConfig = model.cfg
  dtype = dtype or cfg.param_dtype
  if dtype not in _DTYPE_TO_ST:
    raise ValueError(f"dtype must be one of {sorted(_DTYPE_TO_ST)}, got {dtype!r}")
  st_dtype = _DTYPE_TO_ST[dtype]
  np_dtype = _ST_TO_NP[st_dtype]
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
  tensors, owner = [], {}
  for entry in plan:
    shape = tuple(variables[entry.path].get_value().shape)
    for e, name in enumerate(entry.names):
      tensors.append((name, _hf_shape(entry.kind, shape), st_dtype))
      owner[name] = (entry, e)
  shards: list[list] = [[]]
  size = 0
  for t in tensors:
    nbytes = int(np.prod(t[1], dtype=np.int64)) * np_dtype.itemsize
    if shards[-1] and size + nbytes > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(t)
    size += nbytes
  n = len(shards)
  names = [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]

  current: dict[str, Any] = {"path": None, "array": None}

  def produce(name: str) -> np.ndarray:
    entry, e = owner[name]
    if current["path"] != entry.path:
      current["array"] = None  # release the previous parameter before gathering the next
      current["array"] = _to_host(variables[entry.path].get_value()).astype(np_dtype, copy=False)
      current["path"] = entry.path
    arr = current["array"]
    if entry.kind == "plain":
      return arr
    if entry.kind == "transpose":
      return arr.T
    return arr[e].T

  if writer:
    for fname, shard in zip(names, shards):
      _write_safetensors(os.path.join(path, fname), shard, produce)
  else:  # still join every collective gather, in the same order
    for shard in shards:
      for name, _, _ in shard:
        produce(name)
  current["array"] = None
  if writer:
    if n > 1:
      total = sum(int(np.prod(s, dtype=np.int64)) * np_dtype.itemsize for _, s, _ in tensors)
      index = {"metadata": {"total_size": total},
               "weight_map": {t[0]: f for f, shard in zip(names, shards) for t in shard}}
      with open(os.path.join(path, INDEX_FILE), "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
      json.dump(model_config_to_hf(cfg, dtype=dtype, extra=extra_config), f, indent=2)
  written = names + ([INDEX_FILE] if n > 1 else []) + [CONFIG_FILE]
  return written


__all__ = ["CheckpointError", "SUPPORTED_MODEL_TYPES", "hf_to_model_config", "load_hf_config",
           "load_hf_model", "model_config_to_hf", "save_hf_checkpoint"]
