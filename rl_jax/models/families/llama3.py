"""Llama 3 (dense): no q/k norm, no biases, llama3-scaled RoPE; tied or untied embeddings."""
from __future__ import annotations

from rl_jax.models.config import ModelConfig
from rl_jax.models.families.base import Family, HfReader


class Llama3(Family):
  name = "llama3"
  model_types = ("llama",)

  def config_kwargs(self, r: HfReader) -> dict:
    r.refuse("attention_bias", True, "biased attention projections are not implemented for llama")
    r.refuse("mlp_bias", True, "biased MLP projections are not implemented for llama")
    if r.num("pretraining_tp", int, 1) != 1:
      raise r.error(f"key 'pretraining_tp' = {r.hf['pretraining_tp']!r}; only 1 is supported")
    kw = super().config_kwargs(r)
    kw.update(qk_norm=False, qkv_bias=False)
    return kw

  def hf_architecture(self, cfg: ModelConfig) -> str:
    return "LlamaForCausalLM"

  def hf_config(self, cfg: ModelConfig) -> dict:
    return {"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1}
