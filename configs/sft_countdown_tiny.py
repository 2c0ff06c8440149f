"""SFT cold start of the tiny MoE on easy Countdown (3 numbers in 1..9).

Command:
  python -m rl_jax.main --config=configs/sft_countdown_tiny.py --workdir=/tmp/sft_tiny
Hardware: 2 CPU cores. Runtime: about a minute. Expected: held-out greedy accuracy >= 0.2
(0.328 measured; `tests/test_sft.py::test_readme_sft_config_reaches_accuracy`, slow). `:test` gives a seconds-long variant for tests.
"""
import ml_collections

from rl_jax.configs import common


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  cfg = ml_collections.ConfigDict()
  cfg.job = "sft"
  cfg.seed = 0
  cfg.task = ml_collections.ConfigDict(dict(name="countdown_easy", overrides={}))
  cfg.model = common.tiny_moe_model()
  cfg.mesh = common.mesh()
  cfg.optim = ml_collections.ConfigDict(dict(name="adamw", lr=3e-3, schedule="cosine", warmup_steps=50,
                                             total_steps=300, weight_decay=0.0, grad_clip=1.0))
  cfg.sft = ml_collections.ConfigDict(dict(steps=300, batch_size=64, max_len=40, eval_every=300,
                                           eval_size=256, eval_max_new_tokens=12, checkpoint_every=250,
                                           max_to_keep=2))
  cfg.logging = common.logging()
  # On a workdir with checkpoints a changed config fails naming the keys; --config.resume=force resumes anyway.
  cfg.resume = common.RESUME
  if arg == "test":
    cfg.model.n_layers = 2
    cfg.model.d_model = 32
    # head_dim 32 so that fp4's 32-wide blocks fit the KV cache of the test model too.
    cfg.model.n_heads = 2
    cfg.model.n_kv_heads = 1
    cfg.model.head_dim = 32
    cfg.optim.total_steps = 12
    cfg.optim.warmup_steps = 2
    cfg.sft.steps = 12
    cfg.sft.batch_size = 8
    cfg.sft.eval_every = 6
    cfg.sft.eval_size = 8
    cfg.sft.checkpoint_every = 4
    cfg.logging.wandb_mode = "disabled"
  elif arg:
    raise ValueError(f"unknown config arg {arg!r} (valid: 'test')")
  return common.complete(cfg)
