"""Score centering on Countdown with Qwen3-0.6B and an FP8 sampler: [SC]'s 0.6B setting, one 8-GPU host.

Command (arg = a local Hugging Face checkpoint directory of Qwen3-0.6B, i.e. config.json,
model.safetensors and tokenizer.json; `--config.warm_start.path=DIR` does the same; `long:DIR` for
8,192-token responses, see LONG_SAMPLER below):
  python -m rl_jax.main --config=configs/qwen3_0p6b_countdown.py:/ckpt/Qwen3-0.6B \
    --workdir=/runs/qwen3_0p6b_sc_fp8
  sbatch --nodes=1 launch/slurm_gpu.sbatch --config=configs/qwen3_0p6b_countdown.py:/ckpt/Qwen3-0.6B \
    --workdir=/shared/runs/qwen3_0p6b_sc_fp8
Hardware: one host with 8 x H100 80GB (mesh fsdp=8). Runtime: about 2 hours for the
1200 steps ([SC], Table 2: 1,120 H100-hours for the 72 runs of Fig. 4, ~15 H100-hours
per run, with vLLM as sampler; this JAX sampler's speed at this scale is not measured).

Plan (`python -m rl_jax.plan --config=configs/qwen3_0p6b_countdown.py`: XLA:CPU on 8 simulated
devices, memory-optimized scheduler, scanned layers, all 28 layers compiled; GiB per device, H100
80 GB; compile seconds on 2 shared cores, about +-50% run to run; pinned with its commit in
docs/plans/qwen3_0p6b_countdown_h100.json):
                          sync   generate   p_old forward   update
  f32 params              0.28   0.28 res.  0.28            0.28
  FP8 sampler weights     0.09   0.09       0.09 res.       0.09 res.
  FP8 KV cache                   3.05
  other temporaries       0.00   6.72       3.04            11.81
  peak                    0.37   10.17      3.44            12.21   (16% of 80 GB at most: fits)
  model TFLOP                    64.8       62.9            251.7
  roofline s (H100)       0.000  0.522      0.065           0.259   (0.85 s for these per global step)
  compile s               1.2    27.3       3.8             15.2
SGD keeps no optimizer state. Generate is memory-bound (513 reads of the FP8 weights and cache);
the update's temporaries (XLA's buffer report, before the attention change) were the 28 layers'
remat-saved residual stream (f32 [28, 64, 768, 1024], 5.25 GiB), one layer's f32 [64, 16, 768, 768]
attention scores (2.25 GiB per buffer) and the loss's f32 [64 x 64, 151936] logits chunks (2.3 GiB
each); the CPU compile now runs the blocked attention at 768 x 768 (no score buffer: 14.66 -> 11.81
GiB), where an H100 runs cuDNN (the plan's header names the substitution). Unrolled (`--set model.scan_layers=False --layers 2`) the update needs
199 GiB and does not fit: XLA:CPU's temporaries still grow with depth there (the earlier 539 GiB
also had the batch replicated on every device, fixed since by the residual stream's batch
constraint, and the concurrency-optimized scheduler hoisting the remat recomputes).

Setting ([SC] Sec. 5 and App. B): paper Countdown (4 numbers in 1..100, target up to
1000, `<answer>` tags), REINFORCE with group-centered {-1,+1} rewards, 64 prompts x 8
completions, responses up to 512 tokens, SGD lr 1e-2 constant, one optimizer step per
batch (N=1), sampling at temperature 1.0. Trainer: bf16 compute on fp32 master weights.
Sampler: FP8 (e4m3) weights/activations + FP8 KV cache in bf16, recording its top-128
logprobs; loss: top-k score centering with k=128 ([SC], Eqs. 7-12).

Expected ([SC], read off Figs. 1 and 4): a mild-mismatch regime, in which SC trains
stably for the 1200 steps and training accuracy rises from the instruct model's start
to roughly 70-80%, while the train/inference KL stays flat. The separating regimes are
overrides: `--config.sampler.quant=int8_wa_int8_kv` is Fig. 4 left (PG, naive IS, TIS
and MIS collapse; SC, SC+TIS, SC+MIS stay at the top);
`--config.loss.method=tis --config.loss.score_centering=none` is the TIS baseline;
`--config.sampler.quant=none --config.sampler.noise=relative --config.sampler.noise_sigma=0.05`
is Fig. 3 (300 steps: `--config.rl.steps=300`); `--config.rl.staleness=64
--config.sampler.quant=none --config.loss.method=tis` is Fig. 4 right (SC+TIS best).
"""
import dataclasses

import ml_collections

from rl_jax.configs import common
from rl_jax.models.presets import PRESETS

# Qwen3's chat tokenizer: <|im_end|> ends an assistant turn, <|endoftext|> pads.
QWEN3_EOS_ID = 151645
QWEN3_PAD_ID = 151643


def model_section(preset: str, **overrides) -> ml_collections.ConfigDict:
  """The preset's architecture (= the checkpoint's config.json) with job-level precision choices."""
  cfg = dataclasses.replace(PRESETS[preset], **overrides)
  return ml_collections.ConfigDict(dataclasses.asdict(cfg))


# `long` (arg `long` or `long:/ckpt/Qwen3-0.6B`): 8,192-token responses, the memory settings that
# fit them on the same host (per device, of 0.9 x 80 GB: generate 56.0 GiB, evaluation 36.3, the
# update 18.3, first-order 21.2; `python -m rl_jax.plan --config=configs/qwen3_0p6b_countdown.py:long
# --device h100`). Only memory changes: each micro-batch / wave equals the one-shot program.
LONG_SAMPLER = dict(max_new_tokens=8192, prefill_rows=128, max_rows_in_flight=256)
LONG_RL = dict(forward_microbatch=64, update_microbatch=64, eval_rows_in_flight=64)


def parse_arg(arg: str | None) -> tuple[bool, str]:
  """(long responses, checkpoint path) of the config arg: PATH, `long` or `long:PATH`."""
  arg = arg or ""
  if arg == "long" or arg.startswith("long:"):
    return True, arg[len("long:"):]
  return False, arg


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  long, arg = parse_arg(arg)
  cfg = ml_collections.ConfigDict()
  cfg.job = "rl"
  cfg.seed = 0
  cfg.resume = common.RESUME
  cfg.task = ml_collections.ConfigDict(dict(name="countdown", overrides={}))
  # fp32 master weights: with SGD at lr 1e-2 many updates are below bf16's resolution.
  # remat: 64 sequences x 768 tokens per GPU would not keep 28 layers of activations.
  # scan_layers: one lax.scan over the 28 layers (compile time flat in depth; the planner's figures).
  cfg.model = model_section("qwen3-0.6b", dtype="bfloat16", param_dtype="float32", remat=True,
                            scan_layers=True)
  cfg.mesh = common.mesh(data=1, fsdp=8, expert=1, tensor=1)
  cfg.warm_start = ml_collections.ConfigDict(dict(source="hf", path=arg or ""))
  cfg.optim = ml_collections.ConfigDict(dict(name="sgd", lr=1e-2, schedule="constant", warmup_steps=0,
                                             total_steps=0, grad_clip=0.0))
  cfg.sampler = ml_collections.ConfigDict(dict(
      max_prompt_len=256, max_new_tokens=512, temperature=1.0, top_p=1.0, top_k=0, greedy=False,
      record_topk=128, record_experts=False, dtype="bfloat16", noise="none", noise_sigma=0.0,
      quant="fp8_wa_fp8_kv", eos_id=QWEN3_EOS_ID, pad_id=QWEN3_PAD_ID))
  # chunk_size: [64 x 512 x 151936] fp32 logits per GPU would take 20 GB; 64-position chunks 2.5 GB.
  cfg.loss = ml_collections.ConfigDict(dict(method="pg", score_centering="topk", topk=128,
                                            aggregation="batch_tokens", temperature=1.0, chunk_size=64))
  cfg.advantage = ml_collections.ConfigDict(dict(mode="group_centered", reward_mode="pm1"))
  cfg.rl = ml_collections.ConfigDict(dict(
      steps=1200, prompts_per_step=64, group_size=8, n_minibatches=1, staleness=1,
      routing_replay="none", eval_every=50, eval_size=512, eval_temperature=1.0,
      checkpoint_every=50, max_to_keep=2, plot=True,
      # The sampled evaluation's 512 x eval_samples rows in waves of 512 (memory only: each wave
      # equals the one-shot program): all at once, their float32 KV cache alone is 48 GiB per
      # device and the program needs 86.7 GiB, past an H100 (docs/plans/, the planner's exit 1).
      eval_rows_in_flight=512))
  if long:
    cfg.sampler.update(LONG_SAMPLER)
    cfg.rl.update(LONG_RL)
  cfg.logging = common.logging()
  return common.complete(cfg)
