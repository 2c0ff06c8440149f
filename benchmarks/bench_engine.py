"""Sampler engines on ragged, reasoning-like response lengths: continuous batching vs the static engine.

Usage:
  PYTHONPATH=. python benchmarks/bench_engine.py            # 64 rows, heavy tail up to 256 tokens
  PYTHONPATH=. python benchmarks/bench_engine.py --small    # quick run (32 rows, up to 96 tokens)

One random-weight dense Qwen3 model (fp32, recording on: top-k 128 log q, as the RL trainer
samples). Response lengths are forced per row with `generate(max_new_B=...)` (each row stops
after its own number of tokens; EOS is an id no row samples first, so nothing else stops a row):
  - heavy-tailed: log-normal lengths (sigma 1.5) scaled so the longest row has `max_new_tokens`
    (the median ~17x below it at 64 rows: the printed ratio);
  - equal: every row has `max_new_tokens`.
Useful tokens are the tokens that end up in the rollout (the sum of the row lengths); tokens/s
is that over the wall time of one `generate` call (medians of interleaved rounds, compiled
before timing). Variants: static (all rows in one wave), static in waves of `slots` rows
(`max_rows_in_flight`, the same memory as continuous), continuous with `slots` slots (and with
every row in a slot, with and without decode phases, for the equal case). HF transformers' continuous batching
(`generate_batch`) runs when it works on this machine's torch CPU build (else the line says why).
"""
from __future__ import annotations

if __name__ == "__main__":  # before jax loads: XLA:CPU runs re-exec with tcmalloc / jemalloc preloaded
  from rl_jax import host_memory  # pylint: disable=g-import-not-at-top
  host_memory.reexec_tuned()

import argparse
import dataclasses
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rl_jax.models.config import ModelConfig
from rl_jax.models.transformer import Transformer
from rl_jax.sampler import generate as gen
from rl_jax.sampler.config import SamplerConfig

EOS_ID = 1  # prompts hold ids >= 2; a random model's sampled EOS is rare and ends a row in every engine alike


def heavy_tail_lengths(rows: int, longest: int, sigma: float, seed: int) -> np.ndarray:
  """Log-normal lengths `[rows]` in [1, longest], the longest row exactly `longest` tokens."""
  z = np.random.default_rng(seed).standard_normal(rows)
  return np.clip(np.round(longest * np.exp(sigma * (z - z.max()))), 1, longest).astype(np.int32)


def _timed(fn) -> float:
  t0 = time.perf_counter()
  jax.block_until_ready(fn())
  return time.perf_counter() - t0


def _hf_continuous(model, path: str, prompts: np.ndarray, lengths: np.ndarray, slots: int):
  """A callable running HF transformers' `generate_batch` (continuous batching) on the same
  weights with per-row max_new_tokens, or a string saying why it cannot run here."""
  try:
    import torch  # pylint: disable=g-import-not-at-top
    import transformers  # pylint: disable=g-import-not-at-top
    from rl_jax.models import hf  # pylint: disable=g-import-not-at-top
    hf.save_hf_checkpoint(model, path, extra_config=dict(max_position_embeddings=4096), overwrite=True)
    m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                          attn_implementation="sdpa").eval()
    torch.set_num_threads(2)
    gcfg = transformers.GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                         max_new_tokens=int(lengths.max()), eos_token_id=None, pad_token_id=0)

    # Sized by hand: on CPU the automatic sizing reads host memory and took all of it (killed).
    page = 32
    cb_cfg = transformers.ContinuousBatchingConfig(
        page_size=page, num_blocks=len(prompts) * -(-(prompts.shape[1] + int(lengths.max())) // page),
        max_batch_tokens=max(256, slots), max_requests_per_batch=slots, use_cuda_graph=False)

    def run():
      manager = m.init_continuous_batching(generation_config=gcfg, continuous_batching_config=cb_cfg)
      manager.start()
      for i, (p, n) in enumerate(zip(prompts, lengths)):
        manager.add_request(p.tolist(), request_id=f"r{i}", max_new_tokens=int(n))
      done, tokens = 0, 0
      while done < len(prompts):
        r = manager.get_result(timeout=1)
        if r is not None and r.is_finished():
          done, tokens = done + 1, tokens + len(r.generated_tokens)
        elif r is None and not manager.is_running():
          raise RuntimeError("HF's generation thread stopped")
      manager.stop(block=True)
      if tokens != int(lengths.sum()):
        raise AssertionError(f"HF generate_batch made {tokens} tokens, not {int(lengths.sum())}")
      return tokens
    run()  # fails here, not in the timing loop, if it cannot run
    return run
  except Exception as e:  # pylint: disable=broad-except
    return f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--small", action="store_true", help="quick run: 32 rows, up to 96 tokens")
  parser.add_argument("--rows", type=int, default=None)
  parser.add_argument("--slots", type=int, default=None)
  parser.add_argument("--max_new_tokens", type=int, default=None)
  parser.add_argument("--sigma", type=float, default=1.5)
  parser.add_argument("--reps", type=int, default=3)
  parser.add_argument("--record_topk", type=int, default=128)
  parser.add_argument("--hf", action="store_true", help="also time HF transformers' generate_batch")
  parser.add_argument("--workloads", default="heavy-tailed,equal", help="comma-separated: heavy-tailed, equal")
  args = parser.parse_args()
  rows = args.rows or (32 if args.small else 64)
  slots = args.slots or (8 if args.small else 16)
  t = args.max_new_tokens or (96 if args.small else 256)
  p = 16
  mcfg = ModelConfig(vocab_size=1024 if args.small else 4096, d_model=128 if args.small else 256,
                     n_layers=2 if args.small else 4, n_heads=4 if args.small else 8,
                     n_kv_heads=2 if args.small else 4, head_dim=32, d_ff=384 if args.small else 768,
                     tie_embeddings=False, init_std=0.05)
  model = Transformer(mcfg, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  prompts = np.random.default_rng(0).integers(2, mcfg.vocab_size, (rows, p)).astype(np.int32)
  prompts_j, valid_j = jnp.asarray(prompts), jnp.ones((rows, p), bool)
  key = jax.random.key(0)
  base = SamplerConfig(max_prompt_len=p, max_new_tokens=t, temperature=1.0, eos_id=EOS_ID,
                       record_topk=args.record_topk)
  print(f"model: dense d={mcfg.d_model} L={mcfg.n_layers} V={mcfg.vocab_size}; {rows} rows x prompt {p}, "
        f"max_new_tokens {t}, slots {slots}, record_topk {args.record_topk}; host load "
        f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} cores (shared)", flush=True)

  workloads = {"heavy-tailed": heavy_tail_lengths(rows, t, args.sigma, 0),
               "equal": np.full((rows,), t, np.int32)}
  for name in args.workloads.split(","):
    if name not in workloads:
      raise SystemExit(f"--workloads: unknown workload {name!r} (heavy-tailed, equal)")
    lengths = workloads[name]
    med = float(np.median(lengths))
    print(f"\n{name}: lengths median {med:.0f}, max {lengths.max()} ({lengths.max() / med:.1f}x median), "
          f"useful tokens {int(lengths.sum())}", flush=True)
    variants = {"static": base,
                f"static waves of {slots}": dataclasses.replace(base, max_rows_in_flight=slots),
                f"continuous {slots} slots": dataclasses.replace(base, engine="continuous", slots=slots)}
    if name == "equal":
      variants[f"continuous {rows} slots"] = dataclasses.replace(base, engine="continuous", slots=rows)
      # The same without decode phases: every step reads each slot's whole cache.
      variants[f"continuous {rows}, 1 phase"] = dataclasses.replace(base, engine="continuous", slots=rows,
                                                                    decode_phases=1)
    lengths_j = jnp.asarray(lengths)
    runs = {v: (lambda c=c: gen.generate(graphdef, state, prompts_j, valid_j, key, c, max_new_B=lengths_j))
            for v, c in variants.items()}
    useful = {}
    compile_s = {}
    for v, f in runs.items():
      compile_s[v] = _timed(f)
      ro = f()
      useful[v] = int(np.asarray(ro.lengths_B).sum())
    if len(set(useful.values())) != 1:
      raise AssertionError(f"engines made different numbers of tokens: {useful}")
    if name == "heavy-tailed" and args.hf:
      hf_run = _hf_continuous(model, "/tmp/bench_engine_hf", prompts, lengths, slots)
      if isinstance(hf_run, str):
        print(f"  HF generate_batch: cannot run here ({hf_run})", flush=True)
      else:
        runs["HF generate_batch"] = hf_run
        compile_s["HF generate_batch"] = _timed(hf_run)
    times = {v: [] for v in runs}
    for _ in range(args.reps):
      for v, f in runs.items():
        times[v].append(_timed(f))
    tokens = useful["static"]
    ref = "static"
    for v in runs:
      ratio = statistics.median(times[ref][r] / times[v][r] for r in range(args.reps))
      print(f"  {v:26s} {tokens / statistics.median(times[v]):8.0f} useful tok/s   x{ratio:.2f} vs static   "
            f"(first call incl. compile {compile_s[v]:.1f} s)", flush=True)


if __name__ == "__main__":
  main()
