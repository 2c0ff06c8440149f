"""ModelConfig presets (the papers' Qwen3-0.6B / 1.7B / 30B-A3B, Llama-3.1-8B, Qwen1.5-MoE-A2.7B), parameter counts."""
from __future__ import annotations

import dataclasses
import math

import jax
from flax import nnx

from rl_jax.config_utils import ConfigError
from rl_jax.models.config import ModelConfig
from rl_jax.models import families

_QWEN3_COMMON = dict(vocab_size=151936, head_dim=128, rope_theta=1_000_000.0, rms_eps=1e-6)

# Shapes from the models' config.json files on the Hub. dtype / param_dtype keep
# ModelConfig's float32 defaults: pick precision per job with get_preset(..., dtype=...).
PRESETS: dict[str, ModelConfig] = {
    "qwen3-0.6b": ModelConfig(**_QWEN3_COMMON, d_model=1024, n_layers=28, n_heads=16, n_kv_heads=8,
                              d_ff=3072, tie_embeddings=True),
    "qwen3-1.7b": ModelConfig(**_QWEN3_COMMON, d_model=2048, n_layers=28, n_heads=16, n_kv_heads=8,
                              d_ff=6144, tie_embeddings=True),
    "qwen3-30b-a3b": ModelConfig(**_QWEN3_COMMON, d_model=2048, n_layers=48, n_heads=32, n_kv_heads=4,
                                 d_ff=6144, n_experts=128, n_experts_per_tok=8, moe_d_ff=768,
                                 norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=(),
                                 tie_embeddings=False),
    "llama3.1-8b": ModelConfig(family="llama3", qk_norm=False, vocab_size=128256, d_model=4096, n_layers=32,
                               n_heads=32, n_kv_heads=8, head_dim=128, d_ff=14336, rope_theta=500_000.0,
                               rms_eps=1e-5, rope_scaling="llama3", rope_factor=8.0, rope_low_freq_factor=1.0,
                               rope_high_freq_factor=4.0, rope_original_max_positions=8192,
                               tie_embeddings=False),
    "qwen1.5-moe-a2.7b": ModelConfig(family="qwen2_moe", qk_norm=False, qkv_bias=True, vocab_size=151936,
                                     d_model=2048, n_layers=24, n_heads=16, n_kv_heads=16, head_dim=128,
                                     d_ff=5632, n_experts=60, n_experts_per_tok=4, moe_d_ff=1408,
                                     shared_expert_d_ff=5632, norm_topk_prob=False, rope_theta=1_000_000.0,
                                     rms_eps=1e-6, tie_embeddings=False),
}


def get_preset(name: str, **overrides) -> ModelConfig:
  """A preset with ModelConfig field overrides (e.g. dtype='bfloat16', remat=True)."""
  if name not in PRESETS:
    raise ConfigError(f"unknown model preset {name!r}; valid presets: {sorted(PRESETS)}")
  return dataclasses.replace(PRESETS[name], **overrides)


@dataclasses.dataclass(frozen=True)
class ParamCount:
  """Parameter counts; `active` is what one token touches (top-k of each MoE layer's experts)."""
  total: int
  embedding: int       # input embedding + untied output matrix
  non_embedding: int
  active: int
  active_non_embedding: int


def count_params(cfg: ModelConfig) -> ParamCount:
  """Counts parameters of the model of `cfg` from its abstract state (nothing is allocated).

  Routed experts are read from the parameters' `expert` tag (models/moe.py), not from names or
  ranks: in the scanned layout a dense MLP's stacked weights are 3-D and an expert stack 4-D.
  """
  model = families.abstract_model(cfg)
  total = embedding = inactive = 0
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    n = math.prod(var.get_value().shape)
    total += n
    if path[-1] in ("embedding", "w_unembed"):
      embedding += n
    elif var.get_metadata().get("expert", False):
      # A token runs n_experts_per_tok of the E routed experts (a shared expert always runs).
      inactive += n * (cfg.n_experts - cfg.n_experts_per_tok) // cfg.n_experts
  return ParamCount(total=total, embedding=embedding, non_embedding=total - embedding,
                    active=total - inactive, active_non_embedding=total - embedding - inactive)


def abstract_state(cfg: ModelConfig):
  """The model's abstract parameter state (ShapeDtypeStructs with logical axes), no memory."""
  return nnx.state(families.abstract_model(cfg))


def param_bytes(cfg: ModelConfig) -> int:
  """Bytes the parameters take in their storage dtypes."""
  leaves = jax.tree.leaves(abstract_state(cfg))
  return sum(math.prod(x.shape) * x.dtype.itemsize for x in leaves)


__all__ = ["PRESETS", "ParamCount", "abstract_state", "count_params", "get_preset", "param_bytes"]
