"""Qwen3 (dense) and Qwen3-MoE: per-head q/k RMSNorm, no biases, softmax top-k routing."""
from __future__ import annotations

from rl_jax.models.config import ModelConfig
from rl_jax.models.families.base import Family, HfReader


class Qwen3(Family):
  name = "qwen3"
  model_types = ("qwen3", "qwen3_moe")

  def config_kwargs(self, r: HfReader) -> dict:
    r.refuse("attention_bias", True, "Qwen3 has no attention biases")
    kw = super().config_kwargs(r)
    kw.update(qk_norm=True, qkv_bias=False)
    if r.hf.get("model_type") == "qwen3_moe":
      kw.update(n_experts=r.n_experts(), n_experts_per_tok=r.need("num_experts_per_tok"),
                moe_d_ff=r.num("moe_intermediate_size", int, 768),
                norm_topk_prob=bool(r.hf.get("norm_topk_prob", False)),
                decoder_sparse_step=r.num("decoder_sparse_step", int, 1),
                mlp_only_layers=r.mlp_only_layers())
    return kw

  def hf_model_type(self, cfg: ModelConfig) -> str:
    return "qwen3_moe" if cfg.n_experts else "qwen3"

  def hf_architecture(self, cfg: ModelConfig) -> str:
    return "Qwen3MoeForCausalLM" if cfg.n_experts else "Qwen3ForCausalLM"

  def hf_config(self, cfg: ModelConfig) -> dict:
    hf = {"attention_bias": False, "use_sliding_window": False, "sliding_window": None}
    if cfg.n_experts:
      hf.update(num_experts=cfg.n_experts, num_experts_per_tok=cfg.n_experts_per_tok,
                moe_intermediate_size=cfg.moe_d_ff, norm_topk_prob=cfg.norm_topk_prob,
                decoder_sparse_step=cfg.decoder_sparse_step, mlp_only_layers=list(cfg.mlp_only_layers),
                router_aux_loss_coef=cfg.router_aux_loss_coef, output_router_logits=False)
    return hf
