"""Sampler speed: KV-cache generate vs naive no-cache decode, recording overhead, compile time.

Usage:
  PYTHONPATH=. python benchmarks/bench_sampler.py            # batch 32 x 128 new tokens
  PYTHONPATH=. python benchmarks/bench_sampler.py --small    # quick run (batch 8 x 32)

Prints, for a small dense and a small MoE model, in one run: tokens/s of `generate`
and of a naive decode that recomputes the whole (static) buffer every step without a
cache (jitted the same way, with the same sampling), their ratio (target >= 5), the
cost of top-k + expert-id recording as a fraction of sampling time (target <= 10%),
and compile times. Every figure is a ratio measured in the same process, so it is
comparable across machines; absolute tokens/s depend on the host.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rl_jax.logprobs import next_token_logq
from rl_jax.models.config import ModelConfig
from rl_jax.models.transformer import Transformer
from rl_jax.sampler import generate as gen
from rl_jax.sampler.config import SamplerConfig


def _models(small: bool) -> dict[str, ModelConfig]:
  base = dict(vocab_size=2048 if small else 4096, d_model=128 if small else 256, n_layers=2 if small else 4,
              n_heads=4 if small else 8, n_kv_heads=2 if small else 4, head_dim=32, tie_embeddings=False,
              init_std=0.05)
  return {
      "dense": ModelConfig(**base, d_ff=4 * base["d_model"]),
      "moe": ModelConfig(**base, d_ff=4 * base["d_model"], n_experts=8, n_experts_per_tok=2,
                         moe_d_ff=base["d_model"]),
  }


@functools.partial(jax.jit, static_argnames=("graphdef", "cfg", "steps"))
def naive_generate(graphdef, state, prompts_BP, key, *, cfg: SamplerConfig, steps: int):
  """No-cache baseline: every step re-runs the model over the whole [B, S] buffer.

  Same prompt layout (full-length prompts here), same temperature sampling and `logq`
  recording as `generate`, no top-k / expert recording, no early exit. The buffer has
  the static length S = prompt + max_new_tokens, so every step costs the same: timing
  the first `steps` steps measures its tokens/s exactly, without the whole run.
  """
  model = nnx.merge(graphdef, state)
  b, p = prompts_BP.shape
  t = cfg.max_new_tokens
  buf = jnp.concatenate([prompts_BP, jnp.full((b, t), cfg.pad_id, jnp.int32)], axis=1)
  valid = jnp.concatenate([jnp.ones((b, p), bool), jnp.zeros((b, t), bool)], axis=1)
  keys_B = jax.random.split(key, b)

  def step(j, c):
    buf, valid, logq_BT = c
    logits = model(buf, valid_BS=valid).logits_BSV
    logits_BV = jax.lax.dynamic_index_in_dim(logits, p - 1 + j, axis=1, keepdims=False)
    logq_BV = next_token_logq(logits_BV, cfg.temperature)
    step_keys = jax.vmap(jax.random.fold_in, (0, None))(keys_B, j)
    y = jax.vmap(jax.random.categorical)(step_keys, logq_BV).astype(jnp.int32)
    buf = jax.lax.dynamic_update_slice(buf, y[:, None], (0, p + j))
    valid = jax.lax.dynamic_update_slice(valid, jnp.ones((b, 1), bool), (0, p + j))
    logq = jnp.take_along_axis(logq_BV, y[:, None], axis=-1)
    return buf, valid, jax.lax.dynamic_update_slice(logq_BT, logq, (0, j))

  return jax.lax.fori_loop(0, steps, step, (buf, valid, jnp.zeros((b, t), jnp.float32)))


def _time(fn, reps: int) -> float:
  """Best wall time of `reps` runs (the minimum is the least noisy on a shared host)."""
  return min(_time_interleaved([fn], reps)[0][0])


def _time_interleaved(fns, reps: int) -> list[tuple[list[float], list[float]]]:
  """(wall, process CPU) times of `reps` rounds of every fn in turn (A B A B ...).

  Interleaving makes a burst of load from other processes hit every variant alike, and
  the process CPU time (all XLA threads) barely sees other processes at all: on a
  shared CPU host it is the steadier base for a small overhead such as recording.
  """
  times = [([], []) for _ in fns]
  for _ in range(reps):
    for i, fn in enumerate(fns):
      t0, c0 = time.perf_counter(), time.process_time()
      jax.block_until_ready(fn())
      times[i][0].append(time.perf_counter() - t0)
      times[i][1].append(time.process_time() - c0)
  return times


def _compile_time(jitted, *args, **kwargs) -> float:
  t0 = time.perf_counter()
  jitted.lower(*args, **kwargs).compile()
  return time.perf_counter() - t0


def bench(name: str, mcfg: ModelConfig, batch: int, prompt_len: int, new_tokens: int, reps: int,
          naive_steps: int) -> dict:
  model = Transformer(mcfg, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  rng = np.random.default_rng(0)
  prompts = jnp.asarray(rng.integers(2, mcfg.vocab_size, (batch, prompt_len)), jnp.int32)
  valid = jnp.ones((batch, prompt_len), bool)
  key = jax.random.key(0)
  # EOS = an id that random sampling hits with prob. ~1/V per token: no batch finishes
  # early, so every variant does the same number of decode steps.
  base = SamplerConfig(max_prompt_len=prompt_len, max_new_tokens=new_tokens, temperature=1.0, eos_id=1)
  rec = dataclasses.replace(base, record_topk=128, record_experts=True)
  bare = dataclasses.replace(base, record_topk=0, record_experts=False)

  out = {}
  program = gen._generate  # pylint: disable=protected-access
  out["compile_s"] = _compile_time(program, graphdef, state, prompts, valid, key, cfg=rec, kv_spec=None, mesh=None)
  jax.block_until_ready(gen.generate(graphdef, state, prompts, valid, key, bare))  # compile the bare variant
  r = gen.generate(graphdef, state, prompts, valid, key, rec)
  steps = int(np.asarray(r.response_mask_BT).any(0).sum())
  (w_rec, c_rec), (w_bare, c_bare) = _time_interleaved(
      [lambda: gen.generate(graphdef, state, prompts, valid, key, rec),
       lambda: gen.generate(graphdef, state, prompts, valid, key, bare)], reps)
  t_rec, t_bare = min(w_rec), min(w_bare)
  naive_steps = min(naive_steps, new_tokens)
  out["naive_compile_s"] = _compile_time(naive_generate, graphdef, state, prompts, key, cfg=bare, steps=naive_steps)
  jax.block_until_ready(naive_generate(graphdef, state, prompts, key, cfg=bare, steps=naive_steps))
  t_naive = _time(lambda: naive_generate(graphdef, state, prompts, key, cfg=bare, steps=naive_steps), 2)
  out.update(
      steps=steps,
      tok_s=batch * steps / t_rec,
      tok_s_bare=batch * steps / t_bare,
      naive_tok_s=batch * naive_steps / t_naive,
      # Like for like: the naive decode records nothing, so compare with recording off.
      speedup=(batch * steps / t_bare) / (batch * naive_steps / t_naive),
      speedup_recording=(batch * steps / t_rec) / (batch * naive_steps / t_naive),
      record_overhead=(t_rec - t_bare) / t_bare,
      record_overhead_cpu=(min(c_rec) - min(c_bare)) / min(c_bare),
  )
  print(f"{name:6s} | {out['tok_s']:9.0f} tok/s (recording on) | {out['tok_s_bare']:9.0f} tok/s (off) | "
        f"naive {out['naive_tok_s']:8.0f} tok/s | speedup x{out['speedup']:6.1f} (x{out['speedup_recording']:.1f} recording on; target >= 5) | "
        f"recording cost {100 * out['record_overhead']:5.1f}% wall, "
        f"{100 * out['record_overhead_cpu']:5.1f}% CPU time (target <= 10%) | compile "
        f"{out['compile_s']:.1f}s (naive {out['naive_compile_s']:.1f}s) | {steps} steps "
        f"(naive timed over {naive_steps})", flush=True)
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--small", action="store_true", help="quick run: smaller models, batch 8 x 32 tokens")
  parser.add_argument("--batch", type=int, default=None)
  parser.add_argument("--new_tokens", type=int, default=None)
  parser.add_argument("--prompt_len", type=int, default=None)
  parser.add_argument("--reps", type=int, default=None, help="interleaved timing rounds (best is kept)")
  parser.add_argument("--naive_steps", type=int, default=16,
                      help="decode steps the naive baseline is timed over (its per-step cost is constant)")
  args = parser.parse_args()
  batch = args.batch or (8 if args.small else 32)
  new_tokens = args.new_tokens or (32 if args.small else 128)
  prompt_len = args.prompt_len or (16 if args.small else 32)
  reps = args.reps or (10 if args.small else 5)
  print(f"jax {jax.__version__} on {jax.devices()[0].platform} x{jax.device_count()}; batch {batch} x "
        f"{new_tokens} new tokens, prompt {prompt_len}, top-k recorded k=128, best of {reps}")
  for name, mcfg in _models(args.small).items():
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(Transformer(mcfg, rngs=nnx.Rngs(0)))))
    print(f"{name}: V={mcfg.vocab_size} d={mcfg.d_model} L={mcfg.n_layers} experts={mcfg.n_experts} "
          f"params={n_params / 1e6:.2f}M")
    bench(name, mcfg, batch, prompt_len, new_tokens, reps, args.naive_steps)


if __name__ == "__main__":
  main()
