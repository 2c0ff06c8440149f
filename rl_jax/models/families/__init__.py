"""Model families: the explicit registry (name / HF model_type -> Family) and the one model factory."""
from __future__ import annotations

import functools

from rl_jax.config_utils import ConfigError
from rl_jax.models.config import ModelConfig
from rl_jax.models.families.base import Family, HfReader, TensorEntry, checkpoint_dtype
from rl_jax.models.families.llama3 import Llama3
from rl_jax.models.families.qwen2_moe import Qwen2Moe
from rl_jax.models.families.qwen3 import Qwen3

# Explicit, in one place: adding a family is its module plus one line here (no import side effects).
FAMILIES: dict[str, Family] = {f.name: f for f in (Qwen3(), Llama3(), Qwen2Moe())}
MODEL_TYPES: dict[str, Family] = {t: f for f in FAMILIES.values() for t in f.model_types}


def get(name: str) -> Family:
  """The family named `name` (ModelConfig.family); ConfigError naming the key otherwise."""
  if name not in FAMILIES:
    raise ConfigError(f"config key 'model.family': unknown family {name!r}; registered: {sorted(FAMILIES)}")
  return FAMILIES[name]


def of(cfg: ModelConfig) -> Family:
  return get(cfg.family)


def build_model(cfg: ModelConfig, seed: int = 0):
  """The one model factory: `Transformer(cfg)` with parameters from `seed`, after checking the family.
  Wrap in `nnx.eval_shape(lambda: build_model(cfg))` for the abstract model (no memory)."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from rl_jax.models.transformer import Transformer  # pylint: disable=g-import-not-at-top
  get(cfg.family)
  return Transformer(cfg, rngs=nnx.Rngs(seed))


def reference_configs() -> tuple[ModelConfig, ...]:
  """One tiny config per registered family with every block switch on (q/k norm, q/k/v biases, a
  dense and an MoE layer, a shared expert, an untied head): every kind of parameter the blocks
  create, for what is read off the parameters' tags without a model at hand
  (`models.quantize.tagged_names`). A new switch that adds a parameter is turned on here too."""
  return tuple(ModelConfig(family=name, vocab_size=8, d_model=8, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=4,
                           d_ff=8, n_experts=2, n_experts_per_tok=1, moe_d_ff=8, mlp_only_layers=(0,),
                           shared_expert_d_ff=8, qk_norm=True, qkv_bias=True, tie_embeddings=False)
               for name in FAMILIES)


def abstract_model(cfg: ModelConfig):
  """The model with ShapeDtypeStruct parameters (logical axes and tags kept), nothing allocated: a
  fresh module (new Variables) on each call, over the abstract state traced once per config."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  return nnx.merge(*_abstract_split(cfg), copy=True)


def clear_abstract_models() -> None:
  """Forgets the cached abstract states (`abstract_model`): after a change to the model's classes
  themselves (a test that patches one), whose effect the cache, keyed by the config, cannot see."""
  _abstract_split.cache_clear()


@functools.lru_cache(maxsize=16)
def _abstract_split(cfg: ModelConfig):
  # Tracing every parameter's initializer costs ~25 ms a parameter (6 s for the 30B MoE, whose
  # config checks, sampler graph and quantization plan each ask for it): once per config. The
  # leaves are ShapeDtypeStructs (immutable) and `nnx.merge` makes new Variables over them, so no
  # caller can change what the next one gets.
  from flax import nnx  # pylint: disable=g-import-not-at-top
  return nnx.split(nnx.eval_shape(lambda: build_model(cfg)))


__all__ = ["FAMILIES", "Family", "HfReader", "MODEL_TYPES", "TensorEntry", "abstract_model",
           "build_model", "checkpoint_dtype", "clear_abstract_models", "get", "of", "reference_configs"]
