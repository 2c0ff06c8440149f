"""Train-step tokens/s of rl_jax's update vs HF transformers + torch AdamW on the same weights and batch.

Usage:
  PYTHONPATH=. python benchmarks/bench_train_peers.py            # issue 15's models and batch
  PYTHONPATH=. python benchmarks/bench_train_peers.py --small    # quick check (smaller batch, 3 rounds)
  PYTHONPATH=. python benchmarks/bench_train_peers.py --models dense --rounds 9
  PYTHONPATH=. python benchmarks/bench_train_peers.py --attention xla,blocked --response 128,992
  PYTHONPATH=. python benchmarks/bench_train_peers.py --attention xla,native --models study,dense,moe
      # rl_jax against itself, one row per attention implementation (model.attention) and length:
      # step time as a ratio to the first implementation, and the compiled programs' XLA memory
      # stats (temporaries), which show the [S, S] score buffers blocked attention never holds
  PYTHONPATH=. python benchmarks/bench_train_peers.py --torch-device cuda --size gpu --threads 1
      # on a GPU: torch on CUDA against rl_jax on jax's GPU backend, 134M / 361M-param models

Models (issue 15): random Qwen3, vocab 4096, hidden 256, 4 layers, 8 heads x 32, 4 KV heads,
fp32, tied embeddings; 'dense' FFN 768, 'moe' 8 experts top-2, expert FFN 256, every layer MoE.
Batch: B sequences of P prompt + T response tokens (default 32 x (32 + 128)), response
lengths random in [T/2, T] (the mask), advantages fixed.

rl_jax: the trainer's own jitted `rl_jax.rl.step.update` (forward, backward, AdamW, params
and optimizer state donated) on a `TrainBatch` with `logp_old_BT` from `step.old_forward`
(as `RLTrainer.prepare` builds it), loss.method='pg', no score centering, aggregation
'batch_tokens'. The p_old forward is timed too (`step.old_forward` vs torch under no_grad).
HF: the same weights written by `rl_jax.models.hf.save_hf_checkpoint`, loaded by
`transformers.AutoModelForCausalLM.from_pretrained` (float32, torch CPU,
`torch.set_num_threads(--threads)`); logits only at the T response slots
(`logits_to_keep=T + 1`), log_softmax, gather, the same PG loss, `loss.backward()`,
`torch.optim.AdamW` (foreach), `zero_grad(set_to_none=True)`. MoE experts run with
transformers' 'eager' experts_implementation, the fastest here: 'grouped_mm' was ~3x and
'batched_mm' ~15x slower on CPU, and 'batched_mm' gathers one weight matrix per (token,
expert) pair (~10 GB at 8 x 160 tokens; the full batch runs out of a 24 GiB machine).

Like for like: before timing, the two losses (and p_old) at the initial weights must agree
to LOSS_RTOL, and (unless --no-grad-check) every gradient tensor to GRAD_RTOL of its own
max-abs (the rl_jax gradients are written with the same HF writer and read back by
transformers, so the name / layout mapping is the project's and transformers' own). Then
rounds alternate the order (rl_jax, torch / torch, rl_jax), with a --settle pause before each
timed call; medians of the per-round times (and the best round, and process CPU seconds);
tokens/s counts all B * (P + T) tokens the step processes. Ratios > 1: rl_jax faster.

On one H200 (2026-12-04, `--torch-device cuda --size gpu --threads 1 --rounds 5 --batch 32 --prompt 64
--response 448`, jax 0.11.2 against torch 2.11 + transformers 5.17 on CUDA, float32 without TF32 on
both sides): dense update 0.305 s against 0.345 s (1.13x), losses equal to 1.9e-7, gradients to 9.1e-6;
the lease's time limit cut the MoE model and the p_old rows.

Measured on the idle 2-core box (2026-12-02, `--rounds 5`, torch's 2-thread team the best peer, both
engines in this process under tcmalloc, which the script preloads when installed, see
rl_jax/host_memory.py): update 0.86x (dense, 0.95 s against 0.81 s) and 0.77x (MoE, 1.09 s against
0.84 s), CPU seconds 0.88x / 0.79x; p_old 0.93x / 0.83x. Before the blocked causal attention: 0.79x /
0.70x. Under glibc malloc the same day: dense 0.80x (1.37 s against 1.09 s): the allocator speeds
both engines up alike. Losses equal to 0-4e-7 relative, gradients to 2.2e-6. Where the time goes
(jax.profiler / torch.profiler, dense, before the blocked attention): rl_jax's matmuls 586 ms
against torch's 462 ms, attention 291 ms (batched dots, layout copies, separate softmax passes)
against torch's fused flash kernel's 82 ms, the rest about level; docs/performance.md has the
tables and the bound. (Earlier figures on a loaded box, 0.71x / 0.53x against 1-thread torch, and
the "~70 GFLOP/s" XLA matmul rate quoted then, included ~0.5 s per step of page faults.)
"""
from __future__ import annotations

if __name__ == "__main__":  # before jax loads: XLA:CPU runs re-exec with tcmalloc / jemalloc preloaded
  from rl_jax import host_memory  # pylint: disable=g-import-not-at-top
  host_memory.reexec_tuned()

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# pylint: disable=wrong-import-position
from flax import nnx

from rl_jax import host_memory
from rl_jax.models import hf
from rl_jax.models.config import ModelConfig
from rl_jax.optim import OptimConfig, make_optimizer
from rl_jax.rl import step as step_lib
from rl_jax.rl.loss.loss_config import LossConfig
from rl_jax.rl.step import TrainBatch
from rl_jax.train_state import init_params

LOSS_RTOL = 1e-5   # fp32, two implementations: measured ~1e-7
GRAD_RTOL = 1e-4   # per tensor, of its max |g|: measured ~1e-6 (sums over 5k tokens in fp32)
# --dtype bfloat16 (bf16 compute on f32 master weights on both sides: rl_jax's model.dtype, torch's
# autocast): two engines round their bf16 products and activations differently, so the check can
# only tell the same function (differences of a few bf16 roundings, 2**-8 each, through the layers)
# from a wiring error (O(1)): the loss to 2**-6 relative (measured on CPU, issue 15's models: 1.6e-5
# MoE, 3.8e-5 dense); the gradient check is not run.
LOSS_RTOL_BF16 = 2.0**-6

BASE = dict(vocab_size=4096, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=32,
            dtype="float32", param_dtype="float32", tie_embeddings=True)


def _models(base: dict, d_ff: int, n_experts: int, moe_d_ff: int) -> dict:
  """The dense model and its MoE twin (top-2, every layer MoE) on one base."""
  return {"dense": dict(base, d_ff=d_ff),
          "moe": dict(base, d_ff=d_ff, n_experts=n_experts, n_experts_per_tok=2, moe_d_ff=moe_d_ff,
                      norm_topk_prob=True)}


MODELS = _models(BASE, d_ff=768, n_experts=8, moe_d_ff=256)
# --size gpu: models big enough that a GPU step is not launch overhead (134M / 361M params, the MoE ~100M active).
GPU_BASE = dict(vocab_size=32768, d_model=1024, n_layers=8, n_heads=16, n_kv_heads=8, head_dim=64,
                dtype="float32", param_dtype="float32", tie_embeddings=True)
GPU_MODELS = _models(GPU_BASE, d_ff=3072, n_experts=16, moe_d_ff=768)
LOSS = LossConfig(method="pg", score_centering="none", aggregation="batch_tokens")
OPTIM = OptimConfig(name="adamw", lr=1e-5, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0)


def study_model() -> tuple[ModelConfig, dict, int]:
  """configs/countdown_tiny.py's model (the README main job's and every study's) and a batch of its
  step's shape: (config, batch, prompt length), 32 prompts x 8 samples of 24 + 12 tokens."""
  from rl_jax import job_sections  # pylint: disable=g-import-not-at-top
  from rl_jax.configs import countdown_tiny  # pylint: disable=g-import-not-at-top
  cfg = countdown_tiny.get_config()
  model = job_sections.section(cfg, "model", ModelConfig)
  p, t = cfg.sampler.max_prompt_len, cfg.sampler.max_new_tokens
  return model, make_batch(cfg.rl.prompts_per_step * cfg.rl.group_size, p, t, model.vocab_size), p


def make_batch(b, p, t, v, seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(3, v, (b, p + t), dtype=np.int32)
  lengths = rng.integers(t // 2, t + 1, (b,))
  mask = (np.arange(t)[None] < lengths[:, None])
  adv = rng.normal(size=(b,)).astype(np.float32)
  logq = (-3.0 - rng.exponential(size=(b, t))).astype(np.float32)  # pg reads it only in diagnostics
  return dict(tokens=tokens, mask=mask, adv=adv, logq=logq)


# --- rl_jax ---------------------------------------------------------------------------------

class Ours:
  def __init__(self, cfg: ModelConfig, data, p, seed=0, remat=None, attention=None):
    if remat is not None:
      cfg = dataclasses.replace(cfg, remat=remat)
    if attention is not None:
      cfg = dataclasses.replace(cfg, attention=attention)
    self.cfg = cfg
    self.graphdef, self.params = init_params(cfg, seed)
    self.optimizer = make_optimizer(OPTIM)
    self.opt_state = self.optimizer.init(self.params)
    b, s = data["tokens"].shape
    tokens = jnp.asarray(data["tokens"])
    self.batch = TrainBatch(
        prompt_len=p, tokens_BS=tokens,
        positions_BS=jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s)),
        valid_BS=jnp.ones((b, s), bool), response_BT=tokens[:, p:],
        response_mask_BT=jnp.asarray(data["mask"]), logq_BT=jnp.asarray(data["logq"]),
        adv_B=jnp.asarray(data["adv"]))
    kw = dict(graphdef=self.graphdef, loss_cfg=LOSS)
    # The trainer's step functions (rl_jax/rl/programs.py jits the same ones), single device.
    self.old_forward = jax.jit(lambda pr, bt: step_lib.old_forward(pr, bt, **kw)[0])
    self.update = jax.jit(lambda pr, o, bt: step_lib.update(pr, o, bt, **kw, optimizer=self.optimizer,
                                                            aux_coef=0.0), donate_argnums=(0, 1))
    self.loss_and_grad = jax.jit(jax.value_and_grad(
        lambda pr, bt: step_lib.loss_fn(pr, bt, **kw, aux_coef=0.0), has_aux=True))
    self.batch = self.batch.replace(logp_old_BT=self.old_forward(self.params, self.batch))

  def p_old(self):
    return jax.block_until_ready(self.old_forward(self.params, self.batch))

  def step(self):
    self.params, self.opt_state, m = self.update(self.params, self.opt_state, self.batch)
    return float(m["loss"])  # the trainer fetches the metrics every update, too

  def loss_grads(self):
    (loss, _), g = self.loss_and_grad(self.params, self.batch)
    return float(loss), g

  def model(self, params=None):
    return nnx.merge(self.graphdef, self.params if params is None else params)

  def temp_bytes(self) -> dict:
    """XLA's compiled temporaries (bytes) of the update and the p_old forward on this batch."""
    out = {}
    for k, fn, args in (("upd", self.update, (self.params, self.opt_state, self.batch)),
                        ("old", self.old_forward, (self.params, self.batch))):
      out[k] = fn.lower(*args).compile().memory_analysis().temp_size_in_bytes
    return out


# --- HF transformers + torch ----------------------------------------------------------------

class Theirs:
  def __init__(self, path, data, p, threads, attn, experts, device="cpu", dtype="float32"):
    import torch  # pylint: disable=g-import-not-at-top
    import transformers  # pylint: disable=g-import-not-at-top
    self.torch = torch
    self.device = device
    torch.set_num_threads(threads)
    transformers.utils.logging.disable_progress_bar()
    kw = dict(attn_implementation=attn)
    if experts:
      kw["experts_implementation"] = experts
    self.model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw)
    self.model.to(device)
    self.model.train()  # no dropout in Qwen3; train() as a trainer would
    self.opt = torch.optim.AdamW(self.model.parameters(), lr=OPTIM.lr, betas=(OPTIM.b1, OPTIM.b2),
                                 eps=OPTIM.eps, weight_decay=OPTIM.weight_decay, foreach=True)
    self.tokens = torch.from_numpy(data["tokens"].astype(np.int64)).to(device)
    self.attn_mask = torch.ones_like(self.tokens)
    self.mask = torch.from_numpy(data["mask"].astype(np.float32)).to(device)
    self.adv = torch.from_numpy(data["adv"]).to(device)
    self.p = p
    self.t = self.tokens.shape[1] - p
    self.bf16 = dtype == "bfloat16"

  def _logp(self):
    # Slots p-1 .. S-2 predict the response tokens p .. S-1: the last T + 1 logits minus one.
    with self.torch.autocast(device_type=self.device, dtype=self.torch.bfloat16, enabled=self.bf16):
      out = self.model(input_ids=self.tokens, attention_mask=self.attn_mask, logits_to_keep=self.t + 1,
                       use_cache=False)
    logits = out.logits[:, :-1].float()
    logp = torch_log_softmax(self.torch, logits)
    return logp.gather(-1, self.tokens[:, self.p:, None])[..., 0]

  def loss(self):
    logp = self._logp()
    return -(self.adv[:, None] * logp * self.mask).sum() / self.mask.sum().clamp(min=1.0)

  def p_old(self):
    with self.torch.no_grad():
      logp = self._logp()
    if self.device != "cpu":
      self.torch.cuda.synchronize()  # the timers read the host clock
    return logp.cpu()

  def step(self):
    loss = self.loss()
    loss.backward()
    self.opt.step()
    self.opt.zero_grad(set_to_none=True)
    return float(loss.detach())

  def loss_grads(self):
    loss = self.loss()
    loss.backward()
    grads = {n: q.grad.detach().cpu().numpy().copy() for n, q in self.model.named_parameters()}
    self.opt.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


def torch_log_softmax(torch, x):
  return torch.log_softmax(x, dim=-1)


# --- checks and timing -------------------------------------------------------------------------

def check_like_for_like(name, ours: Ours, theirs: Theirs, root, grad_check: bool):
  import transformers  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  lp_ours = np.asarray(ours.p_old())
  lp_theirs = theirs.p_old().numpy()
  mask = np.asarray(ours.batch.response_mask_BT)
  lp_err = np.abs(lp_ours - lp_theirs)[mask].max()
  l_ours, g_ours = ours.loss_grads()
  if grad_check:
    l_theirs, g_theirs = theirs.loss_grads()
  else:
    l_theirs = float(theirs.loss().detach())
  rel = abs(l_ours - l_theirs) / abs(l_theirs)
  tol = LOSS_RTOL_BF16 if theirs.bf16 else LOSS_RTOL
  print(f"[{name}] loss rl_jax {l_ours:.8f} HF {l_theirs:.8f} (rel diff {rel:.1e}, tol {tol:.1e}); "
        f"p_old max |diff| {lp_err:.1e}")
  if theirs.bf16:
    if rel > tol:
      raise SystemExit(f"[{name}] the two bf16 steps do not compute the same loss: not comparable")
    return
  if rel > LOSS_RTOL or lp_err > LOSS_RTOL * 10:
    raise SystemExit(f"[{name}] the two steps do not compute the same loss: not comparable")
  if not grad_check:
    return
  # rl_jax's gradients as a model, through the project's HF writer, read back by transformers:
  # the same (name, layout) transformers holds its own gradients in.
  path = os.path.join(root, f"{name}_grads")
  hf.save_hf_checkpoint(ours.model(g_ours), path)
  g_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
  ours_np = {n: q.detach().numpy() for n, q in g_model.named_parameters()}
  if ours_np.keys() != g_theirs.keys():
    raise SystemExit(f"[{name}] gradient names differ: {sorted(ours_np.keys() ^ g_theirs.keys())}")
  worst, where = 0.0, ""
  for n, g in g_theirs.items():
    err = np.abs(ours_np[n] - g).max() / max(np.abs(g).max(), 1e-30)
    if err > worst:
      worst, where = err, n
  print(f"[{name}] gradients: {len(g_theirs)} tensors, worst max|diff| / max|g| = {worst:.1e} "
        f"({where}), tol {GRAD_RTOL}")
  if worst > GRAD_RTOL:
    raise SystemExit(f"[{name}] gradients disagree: not comparable")


def timed(fn):
  """(wall seconds, process CPU seconds over all threads) of one call."""
  c0, t0 = time.process_time(), time.perf_counter()
  fn()
  return time.perf_counter() - t0, time.process_time() - c0


def bench(name, cfg, data, p, args, root):
  ours = Ours(cfg, data, p, remat=args.remat)
  path = os.path.join(root, name)
  hf.save_hf_checkpoint(ours.model(), path)
  theirs = Theirs(path, data, p, args.threads[0], args.hf_attn, args.hf_experts if cfg.n_experts else None,
                  device=args.torch_device, dtype=cfg.dtype)
  check_like_for_like(name, ours, theirs, root, not args.no_grad_check)
  import torch  # pylint: disable=g-import-not-at-top

  def at(n, fn):  # torch at n threads (a process-wide setting, so set before every call)
    def call():
      torch.set_num_threads(n)
      return fn()
    return call

  # One peer per torch thread count: the best of them (per round) is the baseline.
  runners = [("ours", ours.step, ours.p_old)] + [
      (f"theirs{n}", at(n, theirs.step), at(n, theirs.p_old)) for n in args.threads]
  # Warm-up: compilation (rl_jax) and allocator / thread-pool warm-up (torch).
  for _ in range(2):
    for _, upd, old in runners:
      upd(), old()
  t = {f"{who}_{k}": [] for who, _, _ in runners for k in ("upd", "old")}
  for r in range(args.rounds):
    for who, upd, old in (runners if r % 2 == 0 else runners[::-1]):
      # A pause before each timed call: the other framework's worker threads (XLA's pool,
      # torch's OpenMP team) keep spinning for a while after their work, and on 2 cores
      # that steals the next call's cores.
      time.sleep(args.settle)
      t[f"{who}_upd"].append(timed(upd))
      time.sleep(args.settle)
      t[f"{who}_old"].append(timed(old))
  peers = [f"theirs{n}" for n in args.threads]
  for k in ("upd", "old"):  # the best peer of each round
    t[f"theirs_{k}"] = [min((t[f"{q}_{k}"][r] for q in peers), key=lambda x: x[0]) for r in range(args.rounds)]
  wall = {k: statistics.median(w for w, _ in v) for k, v in t.items()}
  cpu = {k: statistics.median(c for _, c in v) for k, v in t.items()}
  best = {k: min(w for w, _ in v) for k, v in t.items()}
  return wall, cpu, best, t


def bench_attention_impls(name, cfg, data, p, args):
  """rl_jax's step under each `model.attention` in `args.attention`: interleaved timed rounds and
  the compiled temporaries. Returns {impl: (median update s, median p_old s, temp bytes)}."""
  runs = {a: Ours(cfg, data, p, remat=args.remat, attention=a) for a in args.attention}
  first = args.attention[0]
  ref = np.asarray(runs[first].p_old())
  for a, ours in runs.items():  # like for like: the same log-probs to float32 rounding
    err = float(np.abs(np.asarray(ours.p_old()) - ref).max())
    if err > 1e-4:
      raise SystemExit(f"[{name}] attention={a} p_old differs from {first} by {err:.1e}: not comparable")
  mem = {a: ours.temp_bytes() for a, ours in runs.items()}
  for _ in range(2):  # warm-up
    for ours in runs.values():
      ours.step(), ours.p_old()
  t = {a: {"upd": [], "old": []} for a in runs}
  order = list(runs)
  for r in range(args.rounds):
    for a in (order if r % 2 == 0 else order[::-1]):
      time.sleep(args.settle)
      t[a]["upd"].append(timed(runs[a].step)[0])
      time.sleep(args.settle)
      t[a]["old"].append(timed(runs[a].p_old)[0])
  return {a: (statistics.median(t[a]["upd"]), statistics.median(t[a]["old"]), mem[a]) for a in runs}


def main_attention(args):
  """--attention: one table row per (model, response length, implementation)."""
  b, p = args.batch, args.prompt
  print(f"rl_jax train step by model.attention: {b} x ({p} + T) tokens, PG, AdamW; jax {jax.__version__} "
        f"{jax.devices()[0].platform}; {args.rounds} interleaved rounds; host allocator "
        f"{host_memory.describe()}")
  print(f"\n{'model':6} {'S':>5} {'attention':9} {'update s':>9} {'x first':>8} {'p_old s':>8} "
        f"{'x first':>8} {'update temp MiB':>16} {'p_old temp MiB':>15}")
  for name in args.models.split(","):
    if name == "study":  # the study model at its own batch (one row)
      cfg, data, p_study = study_model()
      runs = [(data["tokens"].shape[1] - p_study, data, p_study)]
    else:
      cfg = ModelConfig(**(GPU_MODELS if args.size == "gpu" else MODELS)[name])
      runs = [(t_len, make_batch(b, p, t_len, cfg.vocab_size), p) for t_len in args.response_lengths]
    for t_len, data, p in runs:
      res = bench_attention_impls(name, cfg, data, p, args)
      u0, o0, _ = res[args.attention[0]]
      for a, (u, o, mem) in res.items():
        print(f"{name:6} {p + t_len:5d} {a:9} {u:9.4f} {u / u0:8.2f} {o:8.4f} {o / o0:8.2f} "
              f"{mem['upd'] / 2**20:16.1f} {mem['old'] / 2**20:15.1f}", flush=True)
  print(f"x first: median wall time over the first implementation's ({args.attention[0]}), same "
        "rounds (< 1: faster). temp: XLA's compiled temporaries (memory_analysis), not timed.")


def flops_per_token(cfg: ModelConfig, s: int, t: int) -> dict:
  """Forward matmul FLOPs per token (2 per multiply-add): projections, attention, unembedding."""
  d, hd = cfg.d_model, cfg.head_dim
  attn_proj = d * (cfg.n_heads + 2 * cfg.n_kv_heads) * hd + cfg.n_heads * hd * d
  if cfg.n_experts:
    ffn_used = cfg.n_experts_per_tok * 3 * d * cfg.moe_d_ff + d * cfg.n_experts
  else:
    ffn_used = 3 * d * cfg.d_ff
  scores = 2 * cfg.n_heads * hd * s  # QK^T and PV over S keys; halved below: the causal half
  layers = cfg.n_layers * 2 * (attn_proj + ffn_used + scores / 2)
  unembed = 2 * d * cfg.vocab_size * t / s  # logits only at the T response slots
  return dict(layers=layers, unembed=unembed, total=layers + unembed)


def main():
  ap = argparse.ArgumentParser(description=__doc__)
  ap.add_argument("--small", action="store_true", help="8 x (32 + 64) tokens, 3 rounds")
  ap.add_argument("--models", default="dense,moe")
  ap.add_argument("--batch", type=int, default=32)
  ap.add_argument("--prompt", type=int, default=32)
  ap.add_argument("--response", default="128",
                  help="response tokens T (comma-separated lengths with --attention)")
  ap.add_argument("--rounds", type=int, default=7)
  ap.add_argument("--threads", default="2,1",
                  help="torch thread counts, each timed as a peer; the best per round is the baseline (on "
                       "a shared 2-core host torch's 2-thread team can be slower than 1 thread)")
  ap.add_argument("--settle", type=float, default=1.0,
                  help="seconds of pause before each timed call (lets spinning worker threads sleep)")
  ap.add_argument("--hf-attn", default="sdpa", help="transformers attn_implementation")
  ap.add_argument("--hf-experts", default="eager",
                  help="transformers experts_implementation (MoE)")
  ap.add_argument("--remat", type=int, choices=(0, 1), default=None,
                  help="override model.remat (default: the ModelConfig default)")
  ap.add_argument("--no-grad-check", action="store_true")
  ap.add_argument("--torch-device", default="cpu", choices=("cpu", "cuda"),
                  help="where torch runs (rl_jax runs on jax's default backend); with cuda both run "
                       "float32 matmuls in full float32 (torch's default; jax is set to 'highest')")
  ap.add_argument("--size", default="issue15", choices=("issue15", "gpu"),
                  help="model sizes: issue 15's small models, or 134M / 361M-parameter ones for a GPU")
  ap.add_argument("--attention", default=None,
                  help="compare model.attention implementations (e.g. xla,blocked) in rl_jax alone; no HF peer")
  ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                  help="compute dtype of both steps on float32 master weights (bf16: torch autocast; the "
                       "like-for-like check then compares the loss only, LOSS_RTOL_BF16)")
  ap.add_argument("--json", default="", help="also write the table's rows here (benchmarks/device_check.py reads it)")
  args = ap.parse_args()
  if args.torch_device == "cuda" or jax.default_backend() == "gpu":
    # Like for like with torch's float32 matmuls (no TF32): jax's GPU default would use TF32.
    jax.config.update("jax_default_matmul_precision", "highest")
  models = GPU_MODELS if args.size == "gpu" else MODELS
  args.threads = [int(n) for n in str(args.threads).split(",")]
  args.response_lengths = [int(n) for n in str(args.response).split(",")]
  args.response = args.response_lengths[0]
  if args.small:
    args.batch, args.response, args.rounds = 8, 64, 3
    args.response_lengths = [64]
  if args.attention:
    args.attention = args.attention.split(",")
    main_attention(args)
    return
  b, p, t = args.batch, args.prompt, args.response
  s = p + t
  print(f"train step: {b} x ({p} + {t}) tokens, PG over the response tokens, AdamW; "
        f"jax {jax.__version__} {jax.devices()[0].device_kind}; torch on {args.torch_device}, threads {args.threads}, "
        f"HF attn={args.hf_attn}, experts={args.hf_experts}; {args.dtype} compute; {args.rounds} interleaved rounds; "
        f"host allocator {host_memory.describe()}")
  rows = []
  with tempfile.TemporaryDirectory(prefix="bench_train_peers_") as root:
    for name in args.models.split(","):
      cfg = ModelConfig(**models[name])
      if args.dtype != "float32":  # compute dtype; master weights (param_dtype) stay float32
        cfg = dataclasses.replace(cfg, dtype=args.dtype)
      data = make_batch(b, p, t, cfg.vocab_size)
      med, cpu, best, raw = bench(name, cfg, data, p, args, root)
      fl = flops_per_token(cfg, s, t)
      rows.append((name, med, cpu, best, fl, cfg.remat if args.remat is None else bool(args.remat)))
      hf_rounds = " ".join(f"x{n} {[round(x, 3) for x, _ in raw[f'theirs{n}_upd']]}" for n in args.threads)
      print(f"[{name}] per-round update wall s: rl_jax {[round(x, 3) for x, _ in raw['ours_upd']]} "
            f"HF {hf_rounds}")
  n_tok = b * s
  print(f"\n{'model':6} {'phase':7} {'rl_jax s':>9} {'HF s':>8} {'rl_jax tok/s':>13} {'HF tok/s':>10} "
        f"{'ratio':>6} {'best-of ratio':>13} {'CPU-s ratio':>12} {'rl_jax GFLOP/s':>15}")
  for name, med, cpu, best, fl, remat in rows:
    for phase, mult in (("update", 3), ("p_old", 1)):
      ko, kt = ("ours_upd", "theirs_upd") if phase == "update" else ("ours_old", "theirs_old")
      gflops = fl["total"] * mult * n_tok / med[ko] / 1e9
      print(f"{name:6} {phase:7} {med[ko]:9.4f} {med[kt]:8.4f} {n_tok / med[ko]:13.0f} "
            f"{n_tok / med[kt]:10.0f} {med[kt] / med[ko]:6.2f} {best[kt] / best[ko]:13.2f} "
            f"{cpu[kt] / cpu[ko]:12.2f} {gflops:15.1f}")
  if args.json:
    import json  # pylint: disable=g-import-not-at-top
    with open(args.json, "w") as fh:
      json.dump({"device": jax.devices()[0].device_kind, "torch_device": args.torch_device, "dtype": args.dtype,
                 "tokens": n_tok,
                 "rows": [{"model": name, "phase": phase, "rl_jax_s": med[ko], "hf_s": med[kt]}
                          for name, med, *_ in rows
                          for phase, ko, kt in (("update", "ours_upd", "theirs_upd"),
                                                ("p_old", "ours_old", "theirs_old"))]},
                fh, indent=1)
  print("ratio = HF wall time / rl_jax wall time, medians (> 1: rl_jax faster; target for the "
        "update >= 1.5); best-of: of the fastest round each (the least disturbed by other load); CPU-s ratio: the same with each process's CPU seconds (all threads), "
        "steadier than wall time on a shared machine. GFLOP/s: useful matmul FLOPs (forward per "
        "token x 1 for p_old, x 3 for the update, MoE counting the top-k experts only) per wall second.")
  for name, _, _, _, fl, remat in rows:
    print(f"  {name}: {fl['total'] / 1e6:.2f} MFLOP/token forward (layers {fl['layers'] / 1e6:.2f}, "
          f"unembedding {fl['unembed'] / 1e6:.2f}); model.remat={remat}")


if __name__ == "__main__":
  main()
