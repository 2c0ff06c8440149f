"""Shared config pieces: the tiny CPU models and the sections every job has."""
import ml_collections

# The `resume` key: "check" (a resumed workdir's stored config must match, except the keys in
# rl_jax.workdir.SAFE_TO_CHANGE) or "force".
RESUME = "check"


def tiny_moe_model() -> ml_collections.ConfigDict:
  """A ~0.3M-parameter Qwen3-MoE-shaped model that trains on 2 CPU cores."""
  return ml_collections.ConfigDict(dict(
      vocab_size=80, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128,
      n_experts=4, n_experts_per_tok=2, moe_d_ff=64, norm_topk_prob=True, decoder_sparse_step=1,
      mlp_only_layers=(0,), router_aux_loss_coef=0.01, rope_theta=10000.0, tie_embeddings=True,
      dtype="float32", param_dtype="float32", remat=False, init_std=0.05))


def tiny_dense_model() -> ml_collections.ConfigDict:
  cfg = tiny_moe_model()
  cfg.n_experts = 0
  cfg.mlp_only_layers = ()
  cfg.router_aux_loss_coef = 0.0
  return cfg


def mesh(**axes) -> ml_collections.ConfigDict:
  base = dict(data=1, fsdp=-1, expert=1, tensor=1, num_devices=0, sampler_devices=0)
  base.update(axes)
  return ml_collections.ConfigDict(base)


def logging(wandb_mode: str = "offline") -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(dict(wandb_mode=wandb_mode, wandb_project="rl_jax", run_name=""))


def complete(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Every config file's last step: the schema keys it leaves out, at their defaults, so any key of
  the job's schema is overridable with `--config.SECTION.KEY=VALUE` (rl_jax/config_schema.py)."""
  from rl_jax import config_schema  # pylint: disable=g-import-not-at-top
  return config_schema.complete(cfg)
