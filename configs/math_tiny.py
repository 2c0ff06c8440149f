"""The dataset task on CPU: a tiny MoE on a user's verl-schema math files, or on the generated arithmetic demo.

Command, a user's files (verl's schema: `prompt`, `data_source`, `reward_model.ground_truth`),
two flags:
  python -m rl_jax.tasks.arith --out /tmp/rl_jax_math      # the tokenizer (a byte-level BPE) once
  python -m rl_jax.main --config=configs/math_tiny.py --workdir=/tmp/my_run \
      --config.task.train_files=train.parquet --config.task.eval_files=eval.jsonl
Prompts up to 256 tokens (longer ones are dropped and counted), 64 new tokens, verl's scorer for the
sources it names (openai/gsm8k: '#### x', math_dapo / aime*: 'Answer: x') and the `math` verifier
(the last \\boxed{}) for every other, at least 8 eval prompts (rl.eval_size); the SFT warm start
learns the ground truth written that way first (sft.steps=100). `:test` is a seconds-long variant.

Command, the demo (`:demo`; its data and tokenizer are generated first, in a second):
  python -m rl_jax.tasks.arith --out /tmp/rl_jax_math
  python -m rl_jax.main --config=configs/math_tiny.py:demo --workdir=/tmp/rl_jax_math_run
Another data directory: --config.task.train_files=... --config.task.eval_files=...
--config.task.overrides.tokenizer=DIR/tokenizer (see DATA below for the file names).
Hardware: 2 CPU cores, no accelerator. Runtime: ~5 minutes (SFT warm start included, cached in
<workdir>/warm_start).
Setting: files -> chat template -> sampler -> sandboxed math verifier (math-verify) ->
per-source metrics. Train prompts from a jsonl file (`arith_add`: two steps of + and -) and a
parquet file (`arith_mul`: three steps with a product), sampled 1:1 by source weight; eval on
both sources' held-out files (`eval/<source>/...` metrics). The SFT warm start learns the
worked-solution format (extra_info.solution); RL is plain REINFORCE on group-centred {0, 1}
rewards, 16 prompts x 8 completions, 40 steps. These keys (solution_key, source_weights, the
64-token prompts) are the demo's own: `:demo` sets them.
Expected result (seed 0; measured on 2 CPU cores shared with other jobs, load ~8, 4 min 42 s):
SFT loss 0.31; held-out greedy accuracy 0.125 on both sources after the warm start, and RL does
not raise it at this size (step 40: arith_add 0.078, arith_mul 0.016; avg@4 0.047 / 0.035): the
config shows the data -> template -> sampler -> verifier -> per-source metrics path, not a gain.
"""
import ml_collections

from rl_jax.configs import common

DATA = "/tmp/rl_jax_math"


def task_section(data: str = DATA) -> ml_collections.ConfigDict:
  """A user's files (set on the command line) with the generic keys only: verl's schema, the
  math verifier for sources verl has no scorer of, the tokenizer written by `python -m rl_jax.tasks.arith`."""
  return ml_collections.ConfigDict(dict(
      name="dataset", train_files="", eval_files="",
      overrides=dict(tokenizer=f"{data}/tokenizer", default_verifier="math", enable_thinking="default",
                     verifier_workers=1, verifier_timeout_s=5.0, verifier_memory_mb=2048)))


def demo_task_section(data: str = DATA) -> ml_collections.ConfigDict:
  """The demo's files and its own keys: the worked solutions as SFT targets, its two sources 1:1."""
  cfg = task_section(data)
  cfg.train_files = f"{data}/train_arith_add.jsonl,{data}/train_arith_mul.parquet"
  cfg.eval_files = f"{data}/eval_arith_add.jsonl,{data}/eval_arith_mul.parquet"
  cfg.overrides.update(solution_key="extra_info.solution", source_weights="arith_add=1,arith_mul=1",
                       verifiers="arith_*=math")
  return cfg


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  if arg not in (None, "test", "demo"):
    raise ValueError(f"unknown config arg {arg!r} (valid: 'test', 'demo')")
  cfg = _demo_config()
  if arg != "demo":  # a user's files: their prompts are longer than the demo's 55 tokens
    cfg.task = task_section()
    cfg.sampler.max_prompt_len, cfg.sampler.max_new_tokens = 256, 64
    cfg.sft.update(steps=100, batch_size=16, max_len=320, eval_every=100, eval_size=8, checkpoint_every=100)
    cfg.sft_optim.update(total_steps=100, warmup_steps=10)
    cfg.rl.update(steps=20, prompts_per_step=8, group_size=4, eval_every=10, eval_size=8, eval_samples=2,
                  checkpoint_every=10)
  if arg == "test":
    cfg.model.n_layers = 2
    cfg.model.d_model = 32
    cfg.model.n_heads = 2
    cfg.model.n_kv_heads = 1
    cfg.model.head_dim = 16
    cfg.sft.steps = cfg.sft_optim.total_steps = cfg.sft.eval_every = cfg.sft.checkpoint_every = 4
    cfg.sft.batch_size = 8
    cfg.sft.eval_size = 8
    cfg.sft_optim.warmup_steps = 1
    cfg.sampler.max_prompt_len = 64
    cfg.sampler.max_new_tokens = 16
    cfg.sft.max_len = 96
    cfg.rl.steps = 4
    cfg.rl.prompts_per_step = 4
    cfg.rl.group_size = 2
    cfg.rl.eval_every = 4
    cfg.rl.eval_size = 8
    cfg.rl.eval_samples = 2
    cfg.rl.checkpoint_every = 1
    cfg.rl.plot = False
    cfg.logging.wandb_mode = "disabled"
  return common.complete(cfg)


def _demo_config() -> ml_collections.ConfigDict:
  """The demo as measured (the docstring's figures)."""
  cfg = ml_collections.ConfigDict()
  cfg.job = "rl"
  cfg.seed = 0
  cfg.task = demo_task_section()
  cfg.model = common.tiny_moe_model()
  cfg.model.vocab_size = 384  # rl_jax.tasks.arith.VOCAB_SIZE
  cfg.mesh = common.mesh()
  cfg.warm_start = ml_collections.ConfigDict(dict(source="auto", path=""))
  cfg.sft = ml_collections.ConfigDict(dict(steps=300, batch_size=32, max_len=96, eval_every=300,
                                           eval_size=64, eval_max_new_tokens=32, checkpoint_every=300,
                                           max_to_keep=1))
  cfg.sft_optim = ml_collections.ConfigDict(dict(name="adamw", lr=3e-3, schedule="cosine", warmup_steps=30,
                                                 total_steps=300, weight_decay=0.0, grad_clip=1.0))
  cfg.optim = ml_collections.ConfigDict(dict(name="adamw", lr=3e-4, schedule="constant", warmup_steps=0,
                                             total_steps=0, grad_clip=1.0, weight_decay=0.0))
  # Prompts are ~55 tokens (system + user turn in the chat template), solutions <= 30.
  cfg.sampler = ml_collections.ConfigDict(dict(
      max_prompt_len=64, max_new_tokens=32, temperature=1.0, top_p=1.0, top_k=0, greedy=False,
      record_topk=0, record_experts=True, dtype="float32", noise="none", noise_sigma=0.0,
      quant="none", eos_id=2, pad_id=0))
  cfg.loss = ml_collections.ConfigDict(dict(method="pg", score_centering="none", aggregation="batch_tokens",
                                            temperature=1.0, chunk_size=0))
  cfg.advantage = ml_collections.ConfigDict(dict(mode="group_centered", reward_mode="01"))
  cfg.rl = ml_collections.ConfigDict(dict(
      steps=40, prompts_per_step=16, group_size=8, n_minibatches=1, staleness=1, routing_replay="none",
      eval_every=20, eval_size=128, eval_temperature=1.0, eval_samples=4, checkpoint_every=20,
      max_to_keep=2, plot=True, mode="sync"))
  cfg.logging = common.logging()
  cfg.resume = common.RESUME
  return cfg
