"""Sampler speed against HF transformers `generate` on the same weights, measured side by side.

Usage:
  PYTHONPATH=. python benchmarks/bench_sampler_peers.py           # 32 prompts x 32 tokens, 128 new
  PYTHONPATH=. python benchmarks/bench_sampler_peers.py --small   # quick run (8 x 16, 32 new)
  PYTHONPATH=. python benchmarks/bench_sampler_peers.py --torch-device cuda --size gpu --hf_threads 1
      # on a GPU: HF generate on CUDA (dynamic cache, and its static cache, which transformers
      # compiles with torch.compile on CUDA) against rl_jax on jax's GPU backend; both float32
      # with full float32 matmuls (no TF32); greedy agreement is reported, not required (two
      # engines' float32 kernels round differently, so a near-tie may flip a token)

Two random-weight Qwen3 models (vocab 4096, hidden 256, 4 layers, 8 heads x 32, 4 KV
heads, fp32): dense (FFN 768) and MoE (8 experts, top-2, expert FFN 256, every layer).
Each is written with the project's HF writer (`models/hf.py`) and read back by
transformers, so both engines run the very same weights. Per model and mode (greedy,
T=1; no EOS stop, no truncation) it prints rl_jax's tokens/s as a ratio to the best
HF `generate` variant (torch CPU at 2 and 1 threads; sdpa attention; for the MoE both
eager and grouped_mm experts) with recording off and with recording on (top-k 128
+ expert ids), and the recording cost as a fraction of sampling time. Greedy tokens
must equal HF's exactly (the script fails otherwise). Variants run interleaved
(A B C A B C ...) in one process and the figures are medians of the per-round ratios,
so a burst of load from other processes hits every variant alike.

Measured on the idle 2-core box (2026-12-02, 3 rounds, both engines in this process under tcmalloc,
which the script preloads when installed): rl_jax / best HF with recording off / on: dense greedy
1.60x / 1.12x, dense T=1 1.81x / 1.47x, MoE greedy 1.20x / 0.99x, MoE T=1 1.46x / 1.29x; recording
cost 14-39% (rl_jax dense greedy 6159 / 4457 tok/s, HF 3841). The top-k 128 is the recording cost:
XLA:CPU's single-threaded top-k takes 1.4 ms of a 7.1 ms step (docs/performance.md). Before / after
the heads-major KV cache, same day, glibc malloc (off / on): dense greedy 1.25x / 1.01x -> 1.60x / 1.24x,
dense T=1 1.66x / 1.29x -> 2.09x / 1.69x, MoE greedy 1.15x / 0.99x -> 1.29x / 1.11x, MoE T=1 1.43x / 1.18x -> 1.61x
/ 1.34x.
With the sampler compiled without YNNPACK fusions (`rl_jax/sampler/xla_options.py`; 2026-12-06, 2-core AMD
EPYC box, 3 rounds, before = `RL_JAX_SAMPLER_XLA_DEFAULT=1` in the same hour), off / on: dense greedy 1.41x /
1.23x -> 1.56x / 1.24x, dense T=1 1.83x / 1.50x -> 1.96x / 1.61x, MoE greedy 1.07x / 0.95x -> 1.60x / 1.38x,
MoE T=1 1.50x / 1.32x -> 1.97x / 1.78x.
With the native decode attention and top-k (2026-12-06 night, same box, 3 rounds), off / on: dense greedy
2.02x / 1.89x, dense T=1 2.14x / 2.24x, MoE greedy 1.59x / 1.50x, MoE T=1 1.98x / 2.06x.
With the native top-k's histogram bound (2026-12-07, same box, 3 rounds), off / on: dense greedy 2.01x / 1.88x,
dense T=1 2.34x / 2.51x, MoE greedy 1.81x / 1.70x, MoE T=1 2.36x / 2.06x.
"""
from __future__ import annotations

if __name__ == "__main__":  # before jax loads: XLA:CPU runs re-exec with tcmalloc / jemalloc preloaded
  from rl_jax import host_memory  # pylint: disable=g-import-not-at-top
  host_memory.reexec_tuned()

import argparse
import dataclasses
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from flax import nnx

from rl_jax import host_memory
from rl_jax.models import hf
from rl_jax.models.config import ModelConfig
from rl_jax.models.transformer import Transformer
from rl_jax.sampler import generate as gen
from rl_jax.sampler.config import SamplerConfig

# An id no prompt contains; HF runs with no EOS at all, and a greedy row that emitted it
# would stop early in rl_jax: the greedy parity check below would then fail loudly.
EOS_ID = 1


def _models(small: bool, size: str = "cpu") -> dict[str, ModelConfig]:
  if size == "gpu":  # bench_train_peers' GPU sizes: 134M dense, 361M MoE (16 experts, ~100M active)
    base = dict(vocab_size=32768, d_model=1024, n_layers=8, n_heads=16, n_kv_heads=8, head_dim=64,
                tie_embeddings=False, init_std=0.02)
    return {"dense": ModelConfig(**base, d_ff=3072),
            "moe": ModelConfig(**base, d_ff=3072, n_experts=16, n_experts_per_tok=2, moe_d_ff=768)}
  base = dict(vocab_size=1024 if small else 4096, d_model=128 if small else 256, n_layers=2 if small else 4,
              n_heads=4 if small else 8, n_kv_heads=2 if small else 4, head_dim=32, tie_embeddings=False,
              init_std=0.05)
  d = base["d_model"]
  return {"dense": ModelConfig(**base, d_ff=3 * d),
          "moe": ModelConfig(**base, d_ff=3 * d, n_experts=8, n_experts_per_tok=2, moe_d_ff=d)}


def _hf_model(path: str, attn: str, experts: str, moe: bool, device: str = "cpu"):
  kw = dict(attn_implementation=attn)
  if moe:
    kw["experts_implementation"] = experts
  m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw)
  return m.to(device).eval()


def _hf_generate(m, prompts: np.ndarray, new_tokens: int, greedy: bool, seed: int, threads: int,
                 cache: str = "dynamic") -> np.ndarray:
  """HF generate; `cache` "static": transformers' StaticCache (on CUDA it also compiles the
  forward with torch.compile), "dynamic": the default growing cache."""
  torch.set_num_threads(threads)
  device = next(m.parameters()).device
  ids = torch.from_numpy(prompts.astype(np.int64)).to(device)
  torch.manual_seed(seed)
  kw = dict(cache_implementation="static") if cache == "static" else {}
  with torch.inference_mode():
    out = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                     min_new_tokens=new_tokens, do_sample=not greedy, temperature=1.0, top_k=0, top_p=1.0,
                     eos_token_id=None, pad_token_id=0, use_cache=True, **kw)
  if device.type == "cuda":
    torch.cuda.synchronize()
  return out[:, prompts.shape[1]:].cpu().numpy()


def agreement(ours: np.ndarray, theirs: np.ndarray) -> float:
  """Share of tokens in each row's common prefix with the peer (greedy: identical rows -> 1.0)."""
  same = np.cumprod(ours == theirs, axis=1).astype(bool)
  return float(same.mean())


def _timed(fn) -> float:
  t0 = time.perf_counter()
  jax.block_until_ready(fn())
  return time.perf_counter() - t0


def bench(name: str, mcfg: ModelConfig, batch: int, prompt_len: int, new_tokens: int, reps: int,
          hf_impls: list[tuple[str, str]], hf_threads: list[int], tmp: str, phases: dict,
          device: str = "cpu", caches: tuple[str, ...] = ("dynamic",)) -> list[dict]:
  model = Transformer(mcfg, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  path = f"{tmp}/{name}"
  hf.save_hf_checkpoint(model, path, extra_config=dict(max_position_embeddings=4096))
  moe = mcfg.n_experts > 0
  peers = {f"{a}/{e}" if moe else a: _hf_model(path, a, e, moe, device) for a, e in hf_impls}
  rng = np.random.default_rng(0)
  prompts = rng.integers(2, mcfg.vocab_size, (batch, prompt_len)).astype(np.int32)
  prompts_j, valid_j = jnp.asarray(prompts), jnp.ones((batch, prompt_len), bool)
  key = jax.random.key(0)
  rows = []
  for mode in ("greedy", "T=1"):
    base = SamplerConfig(max_prompt_len=prompt_len, max_new_tokens=new_tokens, temperature=1.0,
                         greedy=mode == "greedy", eos_id=EOS_ID, **phases)
    variants = {"off": dataclasses.replace(base, record_topk=0, record_experts=False),
                "on": dataclasses.replace(base, record_topk=128, record_experts=True)}
    run_jax = {v: (lambda c=c: gen.generate(graphdef, state, prompts_j, valid_j, key, c).tokens_BS)
               for v, c in variants.items()}
    run_hf = {f"{p} {c} x{n}": (lambda m=m, n=n, c=c: _hf_generate(m, prompts, new_tokens, mode == "greedy", 0, n, c))
              for p, m in peers.items() for n in hf_threads for c in caches}
    ours = {v: np.asarray(f())[:, prompt_len:] for v, f in run_jax.items()}  # compiles
    theirs = {p: f() for p, f in run_hf.items()}
    agree = {}
    if mode == "greedy" and device != "cpu":
      agree = {p: agreement(ours["off"], t) for p, t in theirs.items()}
      print(f"{name} greedy: token agreement with HF (common prefix per row): "
            + ", ".join(f"{p} {a:.3f}" for p, a in agree.items()), flush=True)
    elif mode == "greedy":
      for p, t in theirs.items():
        for v, o in ours.items():
          n_eq = int((o == t).sum())
          if n_eq != o.size:
            raise AssertionError(f"{name} greedy: rl_jax (recording {v}) and HF {p} differ in "
                                 f"{o.size - n_eq}/{o.size} tokens")
      print(f"{name} greedy: tokens identical to HF generate ({ours['on'].size}/{ours['on'].size})", flush=True)
    times = {k: [] for k in list(run_jax) + list(run_hf)}
    for _ in range(reps):
      for k, f in list(run_jax.items()) + list(run_hf.items()):
        times[k].append(_timed(f))
    # Per round: best peer of that round; ratio = peer time / our time (= tokens/s ratio).
    best_peer = [min(times[p][r] for p in run_hf) for r in range(reps)]
    ratio = {v: statistics.median(best_peer[r] / times[v][r] for r in range(reps)) for v in run_jax}
    cost = statistics.median((times["on"][r] - times["off"][r]) / times["off"][r] for r in range(reps))
    toks = batch * new_tokens
    med = {k: statistics.median(t) for k, t in times.items()}
    row = dict(model=name, mode=mode, ratio_off=ratio["off"], ratio_on=ratio["on"], record_cost=cost,
               tok_s={k: toks / t for k, t in med.items()}, agreement=agree)
    rows.append(row)
    peer_s = " ".join(f"HF[{p}] {toks / med[p]:6.0f}" for p in run_hf)
    print(f"{name:5s} {mode:6s} | rl_jax/HF x{ratio['off']:.2f} (recording off) x{ratio['on']:.2f} (on) | "
          f"recording cost {100 * cost:5.1f}% | tok/s: rl_jax off {toks / med['off']:6.0f} on {toks / med['on']:6.0f} "
          f"{peer_s}", flush=True)
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--small", action="store_true", help="quick run: smaller models, batch 8 x 16, 32 new tokens")
  parser.add_argument("--reps", type=int, default=None, help="interleaved rounds (medians are reported)")
  parser.add_argument("--models", default="dense,moe")
  parser.add_argument("--hf_impls", default="sdpa/eager,sdpa/grouped_mm",
                      help="attn/experts implementations of HF to time; the best of them is the peer")
  parser.add_argument("--hf_threads", default="2,1",
                      help="torch thread counts to time HF with (the best is the peer): on a shared 2-core host "
                           "torch's 2-thread OpenMP barriers can be >10x slower than 1 thread")
  parser.add_argument("--torch-device", default="cpu", choices=("cpu", "cuda"),
                      help="where HF runs (rl_jax runs on jax's default backend); cuda: float32 without TF32 on both")
  parser.add_argument("--hf-cache", default="",
                      help="HF cache implementations to time, comma-separated (dynamic, static); default "
                           "dynamic on CPU, dynamic,static on CUDA (static: torch.compile'd by transformers)")
  parser.add_argument("--size", default="cpu", choices=("cpu", "gpu"),
                      help="model sizes: the CPU ones above, or bench_train_peers' 134M / 361M GPU models")
  parser.add_argument("--json", default="", help="also write the rows here (benchmarks/device_check.py reads it)")
  parser.add_argument("--decode_phases", type=int, default=None,
                      help="sampler.decode_phases (default: the config's); 1 = one loop over the whole KV cache")
  args = parser.parse_args()
  phases = {} if args.decode_phases is None else {"decode_phases": args.decode_phases}
  transformers.utils.logging.disable_progress_bar()
  transformers.utils.logging.set_verbosity_error()
  batch, prompt_len, new_tokens = (8, 16, 32) if args.small else (32, 32, 128)
  if args.size == "gpu" and not args.small:
    batch, prompt_len, new_tokens = 64, 128, 256
  if args.torch_device == "cuda" or jax.default_backend() == "gpu":
    # Like for like with torch's float32 matmuls (no TF32): jax's GPU default would use TF32.
    jax.config.update("jax_default_matmul_precision", "highest")
  default_caches = "dynamic,static" if args.torch_device == "cuda" else "dynamic"
  caches = tuple(c for c in (args.hf_cache or default_caches).split(",") if c)
  if set(caches) - {"dynamic", "static"}:
    parser.error(f"--hf-cache: {caches} not within dynamic,static")
  reps = args.reps or (5 if args.small else 3)
  impls = [tuple(s.split("/")) for s in args.hf_impls.split(",")]
  threads = [int(n) for n in args.hf_threads.split(",")]
  print(f"jax {jax.__version__} ({jax.devices()[0].platform}), torch {torch.__version__} "
        f"(threads {args.hf_threads}), transformers {transformers.__version__}; "
        f"on {args.torch_device}, HF caches {','.join(caches)}; "
        f"{batch} prompts x {prompt_len} tokens, {new_tokens} new, {reps} interleaved rounds; "
        f"host allocator {host_memory.describe()}")
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    for name, mcfg in _models(args.small, args.size).items():
      if name in args.models.split(","):
        rows += bench(name, mcfg, batch, prompt_len, new_tokens, reps, impls, threads, tmp, phases,
                      args.torch_device, caches)
  if args.json:
    import json  # pylint: disable=g-import-not-at-top
    with open(args.json, "w") as fh:
      json.dump({"device": jax.devices()[0].device_kind, "torch_device": args.torch_device,
                 "batch": batch, "prompt": prompt_len, "new_tokens": new_tokens, "rows": rows}, fh, indent=1)
  print("\n| model | mode | rl_jax / best HF, recording off | recording on | recording cost |")
  print("|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['model']} | {r['mode']} | {r['ratio_off']:.2f}x | {r['ratio_on']:.2f}x | {100 * r['record_cost']:.1f}% |")


if __name__ == "__main__":
  main()
