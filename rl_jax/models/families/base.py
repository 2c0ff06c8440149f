"""Family: what one model family owns (HF config mapping, tensor-name plan, FLOP count); the shared readers."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from rl_jax.models.config import ModelConfig
from rl_jax.models.safetensors_io import CheckpointError

# transformers' PretrainedConfig default when a config has no RoPE keys at all.
HF_DEFAULT_ROPE_THETA = 10_000.0


@dataclasses.dataclass(frozen=True)
class TensorEntry:
  """One rl_jax parameter and the HF tensor(s) it comes from.

  kind: 'plain' (same layout), 'transpose' (HF Linear [out, in] -> [in, out]),
  'experts' (per-expert [out, in] tensors -> stacked [E, in, out]) or, in the scanned
  layout, 'stacked' (`layers`: one per-layer entry per index of the leading layer axis).
  """
  path: tuple
  kind: str
  names: tuple[str, ...]
  layers: tuple["TensorEntry", ...] = ()


class HfReader:
  """Typed reads of a parsed config.json, each error naming the file and the key."""

  def __init__(self, hf: Mapping[str, Any], where: str):
    self.hf, self.where = hf, where

  def error(self, message: str) -> CheckpointError:
    return CheckpointError(f"{self.where}: {message}")

  def num(self, key: str, cast=int, default=None, required: bool = False):
    """hf[key] as int / float; a missing or null key gives `default` (or fails if required)."""
    value = self.hf.get(key)
    if value is None:
      if required:
        raise self.error(f"required key '{key}' is missing (model_type {self.hf.get('model_type')!r})")
      return default
    # JSON numbers only: int("32") would accept a string and int(32.5) would truncate.
    if (isinstance(value, bool) or not isinstance(value, (int, float))
        or (cast is int and not float(value).is_integer())):
      kind = "an integer" if cast is int else "a number"
      raise self.error(f"key '{key}' = {value!r} is not {kind}")
    return cast(value)

  def need(self, key: str, cast=int):
    return self.num(key, cast, required=True)

  def refuse(self, key: str, bad, why: str, default=None) -> None:
    """Fails when hf[key] (default `default`) equals `bad`: a feature this family does not implement."""
    if self.hf.get(key, default) == bad:
      raise self.error(f"key '{key}' = {self.hf.get(key, default)!r} is not supported ({why})")

  def rope(self) -> dict:
    """rope_theta and the RoPE scaling across transformers versions: `rope_parameters` (>= 5) or
    top-level `rope_theta` + `rope_scaling` (4.x). Only default and llama3 scaling exist here."""
    out: dict = {}
    for key in ("rope_parameters", "rope_scaling"):
      params = self.hf.get(key)
      if params is None:
        continue
      if not isinstance(params, Mapping):
        raise self.error(f"key '{key}' must be a mapping or null, got {params!r}")
      rope_type = params.get("rope_type", params.get("type", "default"))
      if rope_type not in ("default", "llama3"):
        raise self.error(f"key '{key}' has rope_type {rope_type!r}; implemented: default, llama3")
      if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise self.error(f"key '{key}.partial_rotary_factor' != 1 is not supported")
      if rope_type == "llama3":
        sub = HfReader(params, f"{self.where} ({key})")
        out.update(rope_scaling="llama3", rope_factor=sub.need("factor", float),
                   rope_low_freq_factor=sub.need("low_freq_factor", float),
                   rope_high_freq_factor=sub.need("high_freq_factor", float),
                   rope_original_max_positions=sub.need("original_max_position_embeddings"))
      if "rope_theta" in params and "rope_theta" not in out:
        out["rope_theta"] = HfReader(params, f"{self.where} ({key})").need("rope_theta", float)
    out.setdefault("rope_theta", self.num("rope_theta", float, HF_DEFAULT_ROPE_THETA))
    return out

  def mlp_only_layers(self) -> tuple[int, ...]:
    mlp_only = self.hf.get("mlp_only_layers") or ()
    if not isinstance(mlp_only, (list, tuple)) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in mlp_only):
      raise self.error(f"key 'mlp_only_layers' = {mlp_only!r} is not a list of layer indices")
    return tuple(mlp_only)

  def n_experts(self) -> int:
    # transformers >= 5 writes num_local_experts for some families (num_experts is an alias).
    key = "num_experts" if self.hf.get("num_experts") is not None else "num_local_experts"
    if self.hf.get(key) is None:
      raise self.error("required key 'num_experts' (or 'num_local_experts') is missing")
    return self.need(key)


def checkpoint_dtype(hf: Mapping[str, Any]) -> str:
  """ModelConfig dtype for a checkpoint's declared dtype (float16 -> float32: lossless)."""
  name = hf.get("dtype", hf.get("torch_dtype")) or "float32"
  name = str(name).replace("torch.", "")
  return "bfloat16" if name == "bfloat16" else "float32"


class Family:
  """A model family: subclasses set the names and override the hooks that differ.

  The defaults implement the Llama-lineage layout every family here shares (HF names
  `model.layers.{i}.self_attn.q_proj`, `mlp.gate_proj`, `mlp.experts.{e}.gate_proj`, ...), with
  the optional parts (q/k norm, q/k/v biases, shared expert) switched by the ModelConfig.
  """
  name: str = ""
  model_types: tuple[str, ...] = ()   # config.json model_type values this family reads

  # ---- config.json <-> ModelConfig ------------------------------------------------------------
  def config_kwargs(self, r: HfReader) -> dict:
    """ModelConfig fields of a config.json (before dtype and user overrides)."""
    hf = r.hf
    if hf.get("hidden_act", "silu") != "silu":
      raise r.error(f"key 'hidden_act' = {hf['hidden_act']!r}; only 'silu' is supported")
    r.refuse("use_sliding_window", True, "sliding-window attention is not implemented")
    n_heads, d_model = r.need("num_attention_heads"), r.need("hidden_size")
    return dict(
        family=self.name,
        vocab_size=r.need("vocab_size"), d_model=d_model, n_layers=r.need("num_hidden_layers"),
        n_heads=n_heads,
        # `or`: transformers treats a 0 / null kv-head count or head_dim as "not set".
        n_kv_heads=r.num("num_key_value_heads") or n_heads,
        head_dim=r.num("head_dim") or d_model // n_heads,
        d_ff=r.need("intermediate_size"),
        rms_eps=r.num("rms_norm_eps", float, 1e-6),
        # Every family here defaults to untied embeddings in transformers.
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_std=r.num("initializer_range", float, 0.02),
        **r.rope())

  def hf_model_type(self, cfg: ModelConfig) -> str:
    return self.model_types[0]

  def hf_architecture(self, cfg: ModelConfig) -> str:
    raise NotImplementedError

  def hf_config(self, cfg: ModelConfig) -> dict:
    """The family's keys of config.json (the common ones are written by `to_hf`)."""
    return {}

  def to_hf(self, cfg: ModelConfig, dtype: str) -> dict:
    """config.json for `cfg` readable by transformers 4.x and 5.x (both RoPE spellings)."""
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling == "llama3":
      rope = {"rope_type": "llama3", "rope_theta": cfg.rope_theta, "factor": cfg.rope_factor,
              "low_freq_factor": cfg.rope_low_freq_factor, "high_freq_factor": cfg.rope_high_freq_factor,
              "original_max_position_embeddings": cfg.rope_original_max_positions}
    hf = {
        "architectures": [self.hf_architecture(cfg)], "model_type": self.hf_model_type(cfg),
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "attention_dropout": 0.0, "max_position_embeddings": 40960, "rms_norm_eps": cfg.rms_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None if cfg.rope_scaling == "none" else dict(rope),
        "rope_parameters": rope, "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std, "use_cache": True, "torch_dtype": dtype,
    }
    hf.update(self.hf_config(cfg))
    return hf

  # ---- parameter <-> HF tensor plan -----------------------------------------------------------
  def layer_tensors(self, cfg: ModelConfig, i: int, is_moe: bool) -> list[TensorEntry]:
    """Layer i's parameters in HF checkpoint order."""
    p, L = f"model.layers.{i}.", ("layers", i)
    out = [TensorEntry(L + ("attn_norm", "scale"), "plain", (p + "input_layernorm.weight",))]
    for ours, theirs in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("o", "o_proj")):
      out.append(TensorEntry(L + ("attn", "w" + ours), "transpose", (f"{p}self_attn.{theirs}.weight",)))
      if cfg.qkv_bias and ours != "o":
        out.append(TensorEntry(L + ("attn", "b" + ours), "plain", (f"{p}self_attn.{theirs}.bias",)))
    if cfg.qk_norm:
      out.append(TensorEntry(L + ("attn", "q_norm", "scale"), "plain", (p + "self_attn.q_norm.weight",)))
      out.append(TensorEntry(L + ("attn", "k_norm", "scale"), "plain", (p + "self_attn.k_norm.weight",)))
    out.append(TensorEntry(L + ("ffn_norm", "scale"), "plain", (p + "post_attention_layernorm.weight",)))
    projections = (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj"))
    if not is_moe:
      return out + [TensorEntry(L + ("ffn", ours), "transpose", (f"{p}mlp.{theirs}.weight",))
                    for ours, theirs in projections]
    out.append(TensorEntry(L + ("ffn", "w_router"), "transpose", (p + "mlp.gate.weight",)))
    for ours, theirs in projections:
      names = tuple(f"{p}mlp.experts.{e}.{theirs}.weight" for e in range(cfg.n_experts))
      out.append(TensorEntry(L + ("ffn", ours), "experts", names))
    if cfg.shared_expert_d_ff:
      out += [TensorEntry(L + ("shared_ffn", ours), "transpose", (f"{p}mlp.shared_expert.{theirs}.weight",))
              for ours, theirs in projections]
      out.append(TensorEntry(L + ("w_shared_gate",), "transpose", (p + "mlp.shared_expert_gate.weight",)))
    return out

  def tensor_plan(self, cfg: ModelConfig) -> list[TensorEntry]:
    """Every parameter of the unrolled layout in HF checkpoint order."""
    out = [TensorEntry(("embedding",), "plain", ("model.embed_tokens.weight",))]
    moe = set(cfg.moe_layers)
    for i in range(cfg.n_layers):
      out += self.layer_tensors(cfg, i, i in moe)
    out.append(TensorEntry(("final_norm", "scale"), "plain", ("model.norm.weight",)))
    if not cfg.tie_embeddings:
      out.append(TensorEntry(("w_unembed",), "transpose", ("lm_head.weight",)))
    return out

  # ---- counts ---------------------------------------------------------------------------------
  def matmul_params(self, cfg: ModelConfig) -> float:
    """Parameters one token multiplies through (MoE: the k routed experts of E and the shared
    expert), the unembedding included: a forward costs 2x this many FLOPs per token, attention aside."""
    m = cfg
    attn = m.d_model * m.head_dim * (2 * m.n_heads + 2 * m.n_kv_heads)
    dense_mlp = 3 * m.d_model * m.d_ff
    moe = 0
    if m.n_experts:
      moe = 3 * m.d_model * m.moe_d_ff * m.n_experts_per_tok + m.d_model * m.n_experts
      moe += 3 * m.d_model * m.shared_expert_d_ff + (m.d_model if m.shared_expert_d_ff else 0)
    n_moe = m.n_moe_layers
    return m.n_layers * attn + (m.n_layers - n_moe) * dense_mlp + n_moe * moe + m.vocab_size * m.d_model
