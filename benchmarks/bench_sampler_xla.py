"""The sampler's XLA:CPU compiler options (`rl_jax/sampler/xla_options.py`) against XLA's default, side by side.

Usage:
  PYTHONPATH=. python benchmarks/bench_sampler_xla.py                  # dense + MoE, recording off and on
  PYTHONPATH=. python benchmarks/bench_sampler_xla.py --models moe --reps 9

The peer benchmark's two models (bench_sampler_peers: random Qwen3, vocab 4096, d 256, 4 layers,
fp32; dense FFN 768, MoE 8 experts top-2 of FFN 256), 32 prompts x 32 tokens, 128 new, no EOS.
Per model, mode (greedy, T=1) and recording (off; top-k 128 + expert ids), `generate_program`
is jitted twice: with the sampler's options (`xla_options.CPU_OPTIONS`: no YNNPACK library
fusions) and with XLA's default. The two run interleaved in one process; the figure is the
median over rounds of default time / options time (> 1: the sampler's options are faster), with
the greedy tokens' agreement and the largest |log q| difference of the two (rounding only: the
dots are the same products, summed by another kernel).

Measured 2026-12-06 on the 2-core AMD EPYC box, study paused (options over XLA's default, recording
off / on): MoE greedy 1.33x / 1.23x, T=1 1.27x / 1.26x (`--reps 5`); dense greedy 1.08x / 1.05x, T=1
1.08x / 1.07x (`--reps 9 --models dense`, load 1.1); greedy tokens identical, log q within 6e-6.
"""
from __future__ import annotations

if __name__ == "__main__":  # before jax loads: XLA:CPU runs re-exec with an allocator preloaded
  from rl_jax import host_memory  # pylint: disable=g-import-not-at-top
  host_memory.reexec_tuned()

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# pylint: disable=wrong-import-position
from flax import nnx

from benchmarks.bench_sampler_peers import EOS_ID, _models
from rl_jax.models.transformer import Transformer
from rl_jax.sampler import generate as gen
from rl_jax.sampler import xla_options
from rl_jax.sampler.config import SamplerConfig


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--models", default="dense,moe")
  ap.add_argument("--reps", type=int, default=5, help="interleaved rounds (medians are reported)")
  ap.add_argument("--batch", type=int, default=32)
  ap.add_argument("--prompt", type=int, default=32)
  ap.add_argument("--new", type=int, default=128)
  args = ap.parse_args()
  if jax.default_backend() != "cpu":
    raise SystemExit(f"the options are XLA:CPU's; this backend is {jax.default_backend()}")
  cfgs = _models(small=False)
  b, p, t = args.batch, args.prompt, args.new
  prompts = jnp.asarray(np.random.default_rng(0).integers(2, 4096, (b, p)).astype(np.int32))
  valid = jnp.ones((b, p), bool)
  jits = {"options": jax.jit(gen.generate_program, static_argnames=gen._STATIC_ARGNAMES,
                             compiler_options=dict(xla_options.CPU_OPTIONS)),
          "default": jax.jit(gen.generate_program, static_argnames=gen._STATIC_ARGNAMES)}
  print(f"jax {jax.__version__}; {b} x ({p} + {t}) tokens; options {xla_options.CPU_OPTIONS}; "
        f"load {os.getloadavg()[0]:.1f}", flush=True)
  for name in args.models.split(","):
    graphdef, state = nnx.split(Transformer(cfgs[name], rngs=nnx.Rngs(0)))
    for mode in ("greedy", "T=1"):
      for rec in (False, True):
        sc = SamplerConfig(max_prompt_len=p, max_new_tokens=t, temperature=1.0, greedy=mode == "greedy",
                           eos_id=EOS_ID, record_topk=128 if rec else 0, record_experts=rec)
        kv = gen.resolve_kv_spec(None, sc)
        run = {k: (lambda j=j: j(graphdef, state, prompts, valid, jax.random.key(0), None, cfg=sc, kv_spec=kv,
                                 mesh=None))
               for k, j in jits.items()}
        out = {k: f() for k, f in run.items()}  # compiles
        same = float(np.mean(np.asarray(out["options"].tokens_BS) == np.asarray(out["default"].tokens_BS)))
        dlogq = float(np.max(np.abs(np.asarray(out["options"].logq_BT) - np.asarray(out["default"].logq_BT))))
        ts = {k: [] for k in run}
        for _ in range(args.reps):
          for k, f in run.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f())
            ts[k].append(time.perf_counter() - t0)
        ratio = statistics.median(d / o for d, o in zip(ts["default"], ts["options"]))
        med = {k: statistics.median(v) for k, v in ts.items()}
        print(f"{name:5s} {mode:6s} recording {'on ' if rec else 'off'} | options x{ratio:.2f} over XLA's default "
              f"({med['options'] * 1e3:.0f} vs {med['default'] * 1e3:.0f} ms) | tokens equal {same:.4f}, "
              f"max |d log q| {dlogq:.1e}", flush=True)
  print(f"load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
  main()
