"""Qwen2-MoE: q/k/v biases, no q/k norm, a sigmoid-gated shared expert beside softmax top-k routing."""
from __future__ import annotations

from rl_jax.models.config import ModelConfig
from rl_jax.models.families.base import Family, HfReader


class Qwen2Moe(Family):
  name = "qwen2_moe"
  model_types = ("qwen2_moe",)

  def config_kwargs(self, r: HfReader) -> dict:
    kw = super().config_kwargs(r)
    # transformers 4.x had no `qkv_bias` key and always biased q / k / v: that is the default.
    kw.update(qk_norm=False, qkv_bias=bool(r.hf.get("qkv_bias", True)),
              n_experts=r.n_experts(), n_experts_per_tok=r.need("num_experts_per_tok"),
              moe_d_ff=r.num("moe_intermediate_size", int, 1408),
              shared_expert_d_ff=r.num("shared_expert_intermediate_size", int, 5632),
              # Qwen2-MoE's default: the top-k probabilities are not renormalized.
              norm_topk_prob=bool(r.hf.get("norm_topk_prob", False)),
              decoder_sparse_step=r.num("decoder_sparse_step", int, 1),
              mlp_only_layers=r.mlp_only_layers())
    if not kw["shared_expert_d_ff"]:
      raise r.error("key 'shared_expert_intermediate_size' = 0: Qwen2-MoE layers always have a shared expert")
    return kw

  def hf_architecture(self, cfg: ModelConfig) -> str:
    return "Qwen2MoeForCausalLM"

  def hf_config(self, cfg: ModelConfig) -> dict:
    return {"qkv_bias": cfg.qkv_bias, "use_sliding_window": False, "sliding_window": None,
            "num_experts": cfg.n_experts, "num_experts_per_tok": cfg.n_experts_per_tok,
            "moe_intermediate_size": cfg.moe_d_ff, "shared_expert_intermediate_size": cfg.shared_expert_d_ff,
            "norm_topk_prob": cfg.norm_topk_prob, "decoder_sparse_step": cfg.decoder_sparse_step,
            "mlp_only_layers": list(cfg.mlp_only_layers), "router_aux_loss_coef": cfg.router_aux_loss_coef,
            "output_router_logits": False}
