"""MiniRL ([MiniRL]) on Qwen3-30B-A3B: FP8 sampler, bf16 trainer, N mini-batches per global step, 4 x 8 GPUs.

Command (arg `nN`, N in {1, 2, 4, 8}, default n1; the checkpoint is a local Hugging Face
directory of a cold-started Qwen3-30B-A3B, read on every host):
  sbatch --nodes=4 launch/slurm_gpu.sbatch --config=configs/qwen3_30b_a3b_minirl.py:n4 \
    --workdir=/shared/runs/minirl_n4 --config.warm_start.path=/shared/ckpt/Qwen3-30B-A3B
Hardware: 4 hosts x 8 x H200 (32 devices; mesh data=1, fsdp=4, expert=8, tensor=1). On one
8-GPU host: --config.mesh.fsdp=1 (expert=8; not planned).
Runtime: not measured on GPUs with this code. A scale estimate from [SC] (Table 2: ~0.1
H100-hour per step of 128 x 1024-token responses on this model) is ~1 H100-hour per
1024-response gradient step, i.e. ~2-3 minutes per mini-batch update on 32 GPUs and
about 1-2 days for the 1000 global steps at N=1 (N times that at N > 1). [MiniRL]'s own
5-6 GPU-hours per step are for 32K-token math responses.
Plan (`python -m rl_jax.plan --config=configs/qwen3_30b_a3b_minirl.py:n4 --device h200`: XLA:CPU
on 32 simulated devices, memory-optimized scheduler, scanned layers, all 48 layers compiled; GiB per
device against 0.9 x 141 GB usable; 6.6 minutes on 2 loaded cores; pinned with its commit and the
substitutions it names in docs/plans/qwen3_30b_a3b_minirl_n4_h200.json):
                          sync   generate  eval greedy  eval sampled  p_old fwd  update (x4)  first-order
  f32 params / AdamW      4.8 / 9.6 in every program (AdamW's moments sharded like the params)
  FP8 KV cache                   10.2      2.5          10.0
  temporaries                    21.6      6.2          10.0          13.1       33.7         45.4
  peak                    15.8   47.6      29.3         40.6          29.0       49.5         61.2
  roofline s (H200)       0.002  20.7      3.9          12.4          19.1       14.6         24.5
Every program fits with more than half the memory free; ~99 s of roofline per global step
(collectives at 50 GB/s per chip, not overlapped: the MoE all-to-all dominates). What made it fit
(peaks before -> after, shard_map dispatch; the intermediate figures from 2- and 4-layer
compiles extrapolated, `--layers 2`): blocked / cuDNN attention, micro-batched
p_old forward and update and the all-to-all dispatch: p_old 1,365 -> 43, update 1,229 -> 104;
the local experts' overflow fallback as rounds of the capacity slab with its own VJP instead of
`lax.ragged_dot` (dense on XLA:CPU and XLA:GPU) and 4 rows per device per update micro-batch:
update -> 49; the first-order meter's cosine summed in place instead of `jnp.vdot` (which
all-gathered every gradient leaf): first-order 274 -> 61; prefill 32 prompts per device at a time
(the FP8 experts still take ragged_dot): generate 93 -> 48. The figures assume no grouped-matmul
kernel: plain-weight experts never call ragged_dot, on any backend.

Setting ([MiniRL], Sec. 4.2): each mini-batch is 64 prompts x 16 responses = 1024
responses; a global step samples N mini-batches (64*N prompts) from the sampler at
theta_old and takes N gradient steps. Loss: MiniRL ([MiniRL], Eq. 7) = REINFORCE with
group-centered rewards (no std), token-level IS weight min(p/q, 5) against the
sampler's logprobs, the staleness mask M_t with eps_low 0.2 / eps_high 0.27, and no
length normalization (aggregation 'constant'). Routing replay as [MiniRL] recommends:
none at N=1, R2 at N=2, R3 at N>=4. FP8 (e4m3) sampler weights/activations/KV cache
in bf16; bf16 trainer compute on fp32 master weights, per-layer remat.
Task: Countdown (the paper preset) stands in for [MiniRL]'s math data (AIME-style problems
with a verifier), which this repository does not ship; any verifiable task with a
{0,1} reward plugs into the same `task` section.
Optimizer: [MiniRL] does not state it; AdamW 1e-6 constant is the usual setting for RL of
Qwen3 models. [SC]'s choice is `--config.optim.name=sgd --config.optim.lr=1e-2`.

Expected ([MiniRL], Figs. 1-4, qualitative on this stand-in task): at N=1 MiniRL trains
stably (no entropy crash, train/inference KL flat around 1e-3) and its accuracy rises
then plateaus; `--config.loss.minirl_train_infer_is=False` collapses within ~200-400
steps; `--config.loss.aggregation=seq_mean` (length normalization) is stable but ends
lower. Off-policy (N=2, 4, 8) converges faster per step when clipping and replay are
on: R2 is the better replay at N=2, R3 at N>=4 (at N=8 only R3 + clipping stays stable
in [MiniRL]); `--config.rl.routing_replay=none` or `--config.loss.minirl_clip=False` at
N>=4 collapses.
"""
import ml_collections

from rl_jax.configs import common
from rl_jax.configs import qwen3_0p6b_countdown as small

N_CHOICES = (1, 2, 4, 8)
# [MiniRL]'s recommendation: on-policy needs no replay; R2 replays the trainer's own theta_old
# routes (unbiased on the first mini-batch), R3 the sampler's (less mismatch when stale).
REPLAY_FOR_N = {1: "none", 2: "R2", 4: "R3", 8: "R3"}
PROMPTS_PER_MINIBATCH = 64
RESPONSES_PER_PROMPT = 16
# Rows per micro-batch over the whole 32-device mesh (8 and 4 rows per device).
FORWARD_MICROBATCH = 256
UPDATE_MICROBATCH = 128
PREFILL_ROWS = 1024


# `nN_32k`: [MiniRL]'s 32,768-token responses. The smallest H200 mesh the planner fits them on is 16
# devices (2 hosts; data=1, fsdp=2, expert=8): per device, of 0.9 x 141 GB, generate 90.0 GiB,
# evaluation 77.3, p_old 60.8, the update 87.7, first-order 110.0 (`python -m rl_jax.plan
# --config=configs/qwen3_30b_a3b_minirl.py:n4_32k --device h200`, all 48 layers compiled). On 8
# (fsdp=1) the update needs 146.5 GiB and first-order 180.9: f32 params + AdamW moments (58 GiB)
# and two gradient copies leave no room for a 33K-token row's activations. Rows per micro-batch: 1
# per device; decode 8 rows per device at a time (a row's FP8 cache is 1.5 GiB); the MoE dispatch in
# 4,096-position chunks (model.moe_seq_chunk: its buffers at one 33K-token row are ~4 GiB each).
LONG_DEVICES = 16
LONG_MESH = dict(data=1, fsdp=2, expert=8, tensor=1, num_devices=LONG_DEVICES)
LONG_SAMPLER = dict(max_new_tokens=32768, prefill_rows=8 * LONG_DEVICES, max_rows_in_flight=8 * LONG_DEVICES)
LONG_RL = dict(forward_microbatch=LONG_DEVICES, update_microbatch=LONG_DEVICES,
               eval_rows_in_flight=2 * LONG_DEVICES)
LONG_MOE_SEQ_CHUNK = 4096


def parse_arg(arg: str | None) -> tuple[int, bool]:
  """(N, 32K-token responses) of the config arg: `nN` or `nN_32k`."""
  if not arg:
    return 1, False
  base, long = (arg[:-len("_32k")], True) if arg.endswith("_32k") else (arg, False)
  if base.startswith("n") and base[1:].isdigit() and int(base[1:]) in N_CHOICES:
    return int(base[1:]), long
  valid = ", ".join(f"n{n}" for n in N_CHOICES)
  raise ValueError(f"unknown config arg {arg!r} (valid: {valid}, each optionally with _32k)")


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  n, long = parse_arg(arg)
  cfg = ml_collections.ConfigDict()
  cfg.job = "rl"
  cfg.seed = 0
  cfg.resume = common.RESUME
  cfg.task = ml_collections.ConfigDict(dict(name="countdown", overrides={}))
  # scan_layers: one lax.scan over the 48 MoE layers: the full model compiles in seconds.
  # moe_dispatch=shard_map: each device sends its (token, slot) rows to the expert shard that
  # owns them (all-to-all) instead of GSPMD gathering weights; attention "auto": cuDNN on GPU (bf16
  # at the static offset 0: the update, p_old and the sampler's prefill), else xla, the blocked
  # lax-loop attention only where xla's f32 scores would pass 4 GiB; expert_matmul "auto": on these GPUs
  # the local experts (and the FP8 sampler's dequantized ones) run the Pallas grouped matmul (no
  # dense [rows, E * F] ragged_dot); the planner's XLA:CPU compile takes the slab in its place.
  cfg.model = small.model_section("qwen3-30b-a3b", dtype="bfloat16", param_dtype="float32", remat=True,
                                  scan_layers=True, moe_dispatch="shard_map", attention="auto",
                                  expert_matmul="auto")
  # 32 devices. Expert weights [128, 2048, 768] split 8-way over experts (16 per shard)
  # and 4-way over d_model (fsdp): 32-way in all. Attention, embeddings and norms
  # (~1.5B params) are split 4-way by fsdp and replicated over the expert axis. The
  # batch is split over all 32 (data x fsdp x expert): the 1024 responses of every update
  # divide by 32 for every N. No tensor parallelism: 4 KV heads would cap it at 4, and
  # 2048-wide matmuls are too small to amortize its all-reduces.
  cfg.mesh = common.mesh(data=1, fsdp=4, expert=8, tensor=1)
  cfg.warm_start = ml_collections.ConfigDict(dict(source="hf", path=""))
  cfg.optim = ml_collections.ConfigDict(dict(name="adamw", lr=1e-6, schedule="constant", warmup_steps=0,
                                             total_steps=0, weight_decay=0.0, grad_clip=1.0))
  # MiniRL reads no top-k distribution (no score centering): record_topk=0 saves the
  # [B, T, k] buffers. Expert ids are recorded for R3 and the routing-agreement metric.
  cfg.sampler = ml_collections.ConfigDict(dict(
      max_prompt_len=256, max_new_tokens=1024, temperature=1.0, top_p=1.0, top_k=0, greedy=False,
      record_topk=0, record_experts=True, dtype="bfloat16", noise="none", noise_sigma=0.0,
      quant="fp8_wa_fp8_kv", eos_id=small.QWEN3_EOS_ID, pad_id=small.QWEN3_PAD_ID,
      # Prefill 32 prompts per device at a time (the quantized experts' ragged_dot is dense on
      # XLA:CPU and XLA:GPU); decode keeps every row in flight (the FP8 cache is 10 GiB).
      prefill_rows=PREFILL_ROWS))
  cfg.loss = ml_collections.ConfigDict(dict(
      method="minirl", score_centering="none", aggregation="constant", temperature=1.0,
      minirl_eps_low=0.2, minirl_eps_high=0.27, minirl_tis_c=5.0, minirl_train_infer_is=True,
      minirl_clip=True, chunk_size=128))
  cfg.advantage = ml_collections.ConfigDict(dict(mode="group_centered", reward_mode="01"))
  cfg.rl = ml_collections.ConfigDict(dict(
      steps=1000, prompts_per_step=PROMPTS_PER_MINIBATCH * n, group_size=RESPONSES_PER_PROMPT,
      n_minibatches=n, staleness=1, routing_replay=REPLAY_FOR_N[n], eval_every=50, eval_size=256,
      eval_temperature=1.0, checkpoint_every=25, max_to_keep=2, plot=True,
      # Memory, not math (results equal the one-shot programs'): the p_old forward 8 rows per
      # device at a time, each update's gradient accumulated over 4 rows per device.
      forward_microbatch=FORWARD_MICROBATCH, update_microbatch=UPDATE_MICROBATCH))
  if long:
    cfg.mesh.update(LONG_MESH)
    cfg.model.moe_seq_chunk = LONG_MOE_SEQ_CHUNK
    cfg.sampler.update(LONG_SAMPLER)
    cfg.rl.update(LONG_RL)
  cfg.logging = common.logging()
  cfg.logging.run_name = f"qwen3_30b_a3b_minirl_n{n}" + ("_32k" if long else "")
  return common.complete(cfg)
