"""What in-flight weight updates cost: compile time of the chunked engine's programs against one generate, and time.

Usage:
  PYTHONPATH=. python benchmarks/bench_inflight.py [--config configs/countdown_tiny_sharp.py] [--chunk 4]

The config's model (random weights: the cost does not depend on them) and sampler section with
`sampler.engine='continuous'`, one RL step's rows (prompts_per_step x group_size, random prompts
of the config's prompt length). Compile: `generate` lowered and compiled once, against the three
programs of `rl_jax/sampler/chunked.py` (start, advance, finish). Run: the median wall time of one
`generate` call and of one chunked rollout (start, advances of `--chunk` iterations with the same
weights, finish) over interleaved rounds, compiled first; the rollouts are checked equal.
"""
from __future__ import annotations

if __name__ == "__main__":  # before jax loads: XLA:CPU runs re-exec with tcmalloc / jemalloc preloaded
  from rl_jax import host_memory  # pylint: disable=g-import-not-at-top
  host_memory.reexec_tuned()

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from rl_jax import train_state
from rl_jax.rl.job import RLJob
from rl_jax.sampler import chunked
from rl_jax.sampler import generate as gen
from rl_jax.sampler import weights as sampler_weights
from rl_jax.study.config import load_base


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--config", default="configs/countdown_tiny_sharp.py")
  ap.add_argument("--chunk", type=int, default=4)
  ap.add_argument("--rounds", type=int, default=5)
  args = ap.parse_args()
  config = load_base(args.config)
  config.sampler.engine = "continuous"
  config.sampler.quant = "none"
  job = RLJob.from_config(config)
  cfg, rl = job.sampler, job.rl
  graphdef, params = train_state.init_params(job.model, 0, None)
  state = sampler_weights.sync_weights(params, None, cfg.quant, cfg.dtype, sampler_weights.quant_plan(job.model))
  sgraph = sampler_weights.sampler_graphdef(job.model, cfg.dtype)
  b, p = rl.prompts_per_step * rl.group_size, cfg.max_prompt_len
  rng = np.random.default_rng(0)
  prompts = jnp.asarray(rng.integers(3, job.model.vocab_size, (b, p)), jnp.int32)
  valid = jnp.ones((b, p), bool)
  key = jax.random.key(0)
  kv = gen.resolve_kv_spec(None, cfg)
  i32 = jnp.int32

  def timed(f):
    t = time.perf_counter()
    f()
    return time.perf_counter() - t

  c_gen = timed(lambda: gen._generate.lower(sgraph, state, prompts, valid, key, cfg=cfg, kv_spec=kv,  # pylint: disable=protected-access
                                            mesh=None).compile())
  carry = jax.eval_shape(lambda: chunked._start(sgraph, state, prompts, valid, key, None, i32(0), i32(1), cfg=cfg,  # pylint: disable=protected-access
                                                kv_spec=kv, mesh=None))
  c_start = timed(lambda: chunked._start.lower(sgraph, state, prompts, valid, key, None, i32(0), i32(1), cfg=cfg,  # pylint: disable=protected-access
                                               kv_spec=kv, mesh=None).compile())
  c_adv = timed(lambda: chunked._advance.lower(sgraph, state, carry, i32(0), i32(1), cfg=cfg, kv_spec=kv,  # pylint: disable=protected-access
                                               mesh=None).compile())
  c_fin = timed(lambda: chunked._finish.lower(carry, cfg=cfg, mesh=None).compile())  # pylint: disable=protected-access
  print(f"{args.config}: {b} rows, S = {p} + {cfg.max_new_tokens}, {jax.devices()[0].platform}")
  print(f"compile s: generate {c_gen:.2f}; chunked start {c_start:.2f} + advance {c_adv:.2f} + finish {c_fin:.2f} "
        f"= {c_start + c_adv + c_fin:.2f} ({(c_start + c_adv + c_fin) / c_gen:.2f}x)")

  def one():
    return gen.generate(sgraph, state, prompts, valid, key, cfg)

  def chunks():
    c = chunked.start(sgraph, state, prompts, valid, key, cfg, version=0, n_iters=args.chunk)
    n = 0
    while chunked.unfinished(c):
      n += 1
      c = chunked.advance(sgraph, state, c, cfg, version=n, n_iters=args.chunk)
    return chunked.finish(c, cfg)

  a, bb = one(), chunks()
  assert np.array_equal(np.asarray(a.tokens_BS), np.asarray(bb.tokens_BS))
  t_one, t_chunks = [], []
  for _ in range(args.rounds):
    t_one.append(timed(lambda: jax.block_until_ready(one())))
    t_chunks.append(timed(lambda: jax.block_until_ready(chunks())))
  m1, m2 = statistics.median(t_one), statistics.median(t_chunks)
  print(f"run s (median of {args.rounds}): generate {m1:.3f}; chunks of {args.chunk} iterations {m2:.3f} "
        f"({m2 / m1:.2f}x)")


if __name__ == "__main__":
  main()
