"""Sampler-side config checks against the model's shapes, run abstractly before any compute."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from rl_jax.config_utils import require
from rl_jax.models import ModelConfig, families
from rl_jax.models.quantize import quantize_params
from rl_jax.ops import kv_quant as qkv
from rl_jax.sampler.config import SamplerConfig


def check_sampler_fits(model_cfg: ModelConfig, s: SamplerConfig) -> None:
  """Quantization block sizes must divide the model's shapes: checked abstractly (no memory)."""
  _, state = nnx.split(families.abstract_model(model_cfg))
  jax.eval_shape(lambda p: quantize_params(p, s.quant), nnx.to_pure_dict(state))
  if s.quant.kv.format not in ("fp32", "bf16"):
    block = s.quant.kv.block_size if s.quant.kv.granularity == "block" else None
    require(block is None or model_cfg.head_dim % block == 0, "sampler.quant.kv.block_size",
            f"{block} does not divide model.head_dim={model_cfg.head_dim}")
    slab = jax.ShapeDtypeStruct((1, 1, model_cfg.n_kv_heads, model_cfg.head_dim), jnp.float32)
    jax.eval_shape(lambda x: qkv.kv_quantize(x, s.quant.kv), slab)
