"""Qwen3 / Qwen3-MoE decoder in Flax NNX, with KV cache, expert ids and routing replay."""
from rl_jax.models.config import ModelConfig
from rl_jax.models.kv_cache import LayerKV, init_cache
from rl_jax.models.transformer import ModelOutput, Transformer

__all__ = ["ModelConfig", "Transformer", "ModelOutput", "LayerKV", "init_cache"]
