"""Qwen3-30B-A3B RL on a user's math data: [SC]'s 30B math recipe (default) or [MiniRL]'s (arg minirl_nN), 4 x 8 GPUs.

Command (the data are the user's verl-schema jsonl / parquet files, local or gs:// / s3://;
the checkpoint is a local Hugging Face directory, read on every host):
  sbatch --nodes=4 launch/slurm_gpu.sbatch --config=configs/qwen3_30b_a3b_math.py \
    --workdir=/shared/runs/math_sc --config.warm_start.path=/shared/ckpt/Qwen3-30B-A3B-Base \
    --config.task.train_files='gs://bucket/math/train-*.parquet' \
    --config.task.eval_files=gs://bucket/math/aime24.parquet,gs://bucket/math/math500.parquet
  (arg `minirl_nN`, N in {1, 2, 4, 8}: [MiniRL]'s layout; `minirl` is minirl_n1.)
(gs:// files need `pip install 'rl_jax[gcs]'` on every host.)
Check what the model will see first (no GPU): python -m rl_jax.tasks preview
  --config=configs/qwen3_30b_a3b_math.py --config.warm_start.path=... --config.task.train_files=...
The trained policy as an HF checkpoint (its config.json, tokenizer and generation config carried
over from warm_start.path): python -m rl_jax.export --workdir=/shared/runs/math_sc --out=DIR
Hardware: 4 hosts x 8 x H200 (32 devices; the mesh of configs/qwen3_30b_a3b_minirl.py).
Runtime: not measured on GPUs with this code; the per-step estimate of qwen3_30b_a3b_minirl.py
applies ([SC]'s 128 responses x 1024 tokens per step: ~0.1 H100-hour per step, its Table 2).
Plan (`python -m rl_jax.plan --config=configs/qwen3_30b_a3b_math.py --device h200 --layers 2
--programs generate,update,first_order`: XLA:CPU, 32 simulated devices, 2- and 4-layer compiles
extrapolated to 48; ~13 min on 2 loaded cores). The SC recipe's peak GiB per device of 0.9 x 141 GB:
generate 10.9 (FP8 weights, 0.16 KV cache), update 33.8 (f32 params 4.8, SGD: no optimizer state),
first-order 39.5; roofline ~2.8 s per global step (H200, collectives not overlapped). The
minirl_nN variants are qwen3_30b_a3b_minirl.py's sections exactly (planned there).
Setting, default ([SC], its 30B run on the math subset of INTELLECT-2): 16 prompts x 8
responses per step, responses up to 1024 tokens, REINFORCE with group-centred {-1, +1} rewards
(advantage.reward_mode='pm1'), top-k score centering (k=128), SGD lr 1e-2 constant, one update
per step; FP8 sampler. minirl_nN ([MiniRL], Sec. 4.2): 64 prompts x 16 responses per
mini-batch, N mini-batches per global step, the MiniRL loss (token IS min(p/q, 5), staleness
mask eps 0.2 / 0.27, no length normalization), replay none / R2 / R3 at N = 1 / 2 / >= 4, AdamW
1e-6.
Task: `task.name=dataset`; a data_source verl names gets verl's scorer (openai/gsm8k: gsm8k's
'#### x'; math_dapo, math, aime*: DAPO's 'Answer: x'; the MATH sets: math), every other the math
verifier (math-verify on the last \\boxed{}, in the sandboxed workers), unless
`task.overrides.verifiers` maps it elsewhere; prompts longer than
sampler.max_prompt_len (256) after the chat template are dropped and counted
(data/train_dropped_too_long). Per-source metrics: train/<source>/*, eval/<source>/*.
Expected ([SC], Fig. 5, qualitative): training accuracy rises steadily over the run with the
train/inference KL flat under SC; [MiniRL] (Figs. 1-4): stable at N=1, faster per step at N>1
with R2 / R3 and clipping.
"""
import ml_collections

from rl_jax.configs import common
from rl_jax.configs import qwen3_30b_a3b_minirl as minirl

# Verifier processes per host: 128 completions per step at ~2-5 ms per math-verify call.
VERIFIER_WORKERS = 8


def task_section() -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(dict(
      name="dataset", train_files="", eval_files="",
      overrides=dict(default_verifier="math", verifiers="", source_weights="", enable_thinking="default",
                     system_prompt="", verifier_workers=VERIFIER_WORKERS, verifier_timeout_s=10.0,
                     verifier_memory_mb=4096)))


def parse_arg(arg: str | None) -> tuple[str, int]:
  """('sc', 1) for the default, ('minirl', N) for `minirl` / `minirl_nN`."""
  if not arg or arg == "sc":
    return "sc", 1
  if arg == "minirl":
    return "minirl", 1
  if arg.startswith("minirl_"):
    n, _ = minirl.parse_arg(arg[len("minirl_"):])
    return "minirl", n
  raise ValueError(f"unknown config arg {arg!r} (valid: sc, minirl, minirl_nN with N in {minirl.N_CHOICES})")


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  recipe, n = parse_arg(arg)
  cfg = minirl.get_config(f"n{n}")
  cfg.task = task_section()
  cfg.logging.run_name = f"qwen3_30b_a3b_math_{recipe}" + (f"_n{n}" if recipe == "minirl" else "")
  if recipe == "sc":
    cfg.optim.update(dict(name="sgd", lr=1e-2, schedule="constant", grad_clip=0.0))
    cfg.sampler.record_topk = 128
    cfg.loss.update(dict(method="pg", score_centering="topk", topk=128, aggregation="batch_tokens"))
    cfg.advantage.reward_mode = "pm1"
    # 128 responses per step: one update, micro-batches of the 128 rows (4 per device).
    cfg.rl.update(dict(prompts_per_step=16, group_size=8, n_minibatches=1, routing_replay="none",
                       forward_microbatch=128, update_microbatch=128))
  return common.complete(cfg)
