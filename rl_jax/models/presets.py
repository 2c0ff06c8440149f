"""ModelConfig presets for the papers' models (Qwen3-0.6B / 1.7B / 30B-A3B) and abstract parameter counts."""
from __future__ import annotations

import dataclasses
import math

import jax
from flax import nnx

from rl_jax.config_utils import ConfigError
from rl_jax.models.config import ModelConfig
from rl_jax.models.transformer import Transformer

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
  """Counts parameters of `Transformer(cfg)` from `nnx.eval_shape` (nothing is allocated)."""
  model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  total = embedding = inactive = 0
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    n = math.prod(var.get_value().shape)
    total += n
    if path[-1] in ("embedding", "w_unembed"):
      embedding += n
    elif path[-1] in ("w_gate", "w_up", "w_down") and len(var.get_value().shape) == 3:
      # Stacked experts [E, ...]: a token runs n_experts_per_tok of the E.
      inactive += n * (cfg.n_experts - cfg.n_experts_per_tok) // cfg.n_experts
  return ParamCount(total=total, embedding=embedding, non_embedding=total - embedding,
                    active=total - inactive, active_non_embedding=total - embedding - inactive)


def abstract_state(cfg: ModelConfig):
  """The model's abstract parameter state (ShapeDtypeStructs with logical axes), no memory."""
  return nnx.state(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))


def param_bytes(cfg: ModelConfig) -> int:
  """Bytes the parameters take in their storage dtypes."""
  leaves = jax.tree.leaves(abstract_state(cfg))
  return sum(math.prod(x.shape) * x.dtype.itemsize for x in leaves)


__all__ = ["PRESETS", "ParamCount", "abstract_state", "count_params", "get_preset", "param_bytes"]
