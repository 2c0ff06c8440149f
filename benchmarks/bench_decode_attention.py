"""The decode step's attention on CPU: the native handler against XLA's batched dots, same operands.

Usage:
  PYTHONPATH=. python benchmarks/bench_decode_attention.py            # the shapes below, 5 rounds
  PYTHONPATH=. python benchmarks/bench_decode_attention.py --rounds 9
  PYTHONPATH=. python benchmarks/bench_decode_attention.py --generate  # also whole generate calls

One query token per row over a float32 heads-major KV cache (`layers._decode_attention`), at
the peer benchmark's models (B 32, 4 kv heads x 2 queries, head dim 32; caches of 64 and 160
slots) and at Qwen3-0.6B's attention shape (8 kv heads x 2, head dim 128; 512 and 2048 slots).
Each call reads a different cache of a ring of 8 (as a decode loop reads each layer's cache once,
not from a warm L1/L2). Prints microseconds per call of each, the ratio XLA / native (median of
`--rounds` interleaved rounds) and the largest difference of the outputs. `--generate` adds the
peer benchmark's `generate` (its models and batch, greedy and T=1, recording off and on), traced
with and without the handler in one process, interleaved: seconds per call and XLA / native.
"""
from __future__ import annotations

if __name__ == "__main__":  # before jax loads, as bench_sampler_peers: the tuned host allocator
  from rl_jax import host_memory  # pylint: disable=g-import-not-at-top
  host_memory.reexec_tuned()

import argparse
import functools
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from rl_jax.models import layers
from rl_jax.ops import native_attention
from rl_jax.sampler import xla_options

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_sampler_peers, for --generate

SHAPES = {  # name: (B, G, R, D, C)
    "peer model, C 64": (32, 4, 2, 32, 64),
    "peer model, C 160": (32, 4, 2, 32, 160),
    "Qwen3-0.6B, B 16, C 512": (16, 8, 2, 128, 512),
    "Qwen3-0.6B, B 8, C 2048": (8, 8, 2, 128, 2048),
}
RING = 8


def _variant(native: bool):
  """A jitted loop of RING calls (one per cache of the ring), traced with or without the handler."""
  def program(q_BGRD, kT_BGDC_ring, v_BGCD_ring, mask_BC):
    saved = native_attention.usable_for
    if not native:
      native_attention.usable_for = lambda *a: False
    try:
      return sum(layers._decode_attention(q_BGRD + i, kT_BGDC_ring[i], v_BGCD_ring[i], mask_BC)  # pylint: disable=protected-access
                 for i in range(RING))
    finally:
      native_attention.usable_for = saved
  return jax.jit(program, compiler_options=xla_options.compiler_options())


def _generate_rows(rounds: int) -> list[tuple]:
  """The peer benchmark's generate with the handler against without it, same process, interleaved."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  import bench_sampler_peers  # pylint: disable=g-import-not-at-top
  from rl_jax.models.transformer import Transformer  # pylint: disable=g-import-not-at-top
  from rl_jax.sampler import generate as gen  # pylint: disable=g-import-not-at-top
  from rl_jax.sampler.config import SamplerConfig  # pylint: disable=g-import-not-at-top
  rows = []
  for name, mcfg in bench_sampler_peers._models(False).items():  # pylint: disable=protected-access
    graphdef, state = nnx.split(Transformer(mcfg, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(0)
    prompts = jnp.asarray(rng.integers(2, mcfg.vocab_size, (32, 32)).astype(np.int32))
    valid = jnp.ones((32, 32), bool)
    for mode, rec in (("greedy", False), ("T=1", False), ("greedy", True), ("T=1", True)):
      cfg = SamplerConfig(max_prompt_len=32, max_new_tokens=128, temperature=1.0, greedy=mode == "greedy",
                          eos_id=bench_sampler_peers.EOS_ID, record_topk=128 if rec else 0, record_experts=rec)
      runs = {}
      for native in (False, True):
        def program(*a, **k):  # a new function object per variant: jax reuses a function's trace
          return gen.generate_program(*a, **k)
        fn = jax.jit(program, static_argnames=gen._STATIC_ARGNAMES,  # pylint: disable=protected-access
                     compiler_options=xla_options.compiler_options())
        call = functools.partial(fn, graphdef, state, prompts, valid, jax.random.key(0), None, cfg=cfg,
                                 kv_spec=None, mesh=None)
        saved = native_attention.usable_for
        if not native:
          native_attention.usable_for = lambda *a: False
        try:
          out = jax.block_until_ready(call())  # traces and compiles here
        finally:
          native_attention.usable_for = saved
        runs["native" if native else "xla"] = (call, out)
      if mode == "greedy":  # the same greedy tokens either way (float rounding apart, no near-tie here)
        np.testing.assert_array_equal(np.asarray(runs["xla"][1].tokens_BS), np.asarray(runs["native"][1].tokens_BS))
      times = {k: [] for k in runs}
      for i in range(rounds):
        for k in (list(runs) if i % 2 == 0 else list(runs)[::-1]):
          t0 = time.perf_counter()
          jax.block_until_ready(runs[k][0]().tokens_BS)
          times[k].append(time.perf_counter() - t0)
      ratio = statistics.median(x / n for x, n in zip(times["xla"], times["native"]))
      label = f"{name} {mode}, recording {'on' if rec else 'off'}"
      rows.append((label, statistics.median(times["xla"]), statistics.median(times["native"]), ratio))
      print(f"{label:32s} | XLA {rows[-1][1]:.3f} s | native {rows[-1][2]:.3f} s | x{ratio:.2f}", flush=True)
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--calls", type=int, default=10, help="timed calls of the RING-loop per round")
  parser.add_argument("--generate", action="store_true", help="also the peer benchmark's generate, with and without")
  args = parser.parse_args()
  if not native_attention.available():
    raise SystemExit("the native decode attention is not available here (see the warning above)")
  print(f"jax {jax.__version__} ({jax.default_backend()}), {jax.device_count()} device(s)")
  rows = []
  for name, (b, g, r, d, c) in SHAPES.items():
    ks = jax.random.split(jax.random.key(c), 2 * RING + 2)
    # The ring as separate arrays (a slice of one stacked array would be copied before each call).
    ops = (jax.random.normal(ks[0], (b, g, r, d)),
           tuple(jax.random.normal(k, (b, g, d, c)) for k in ks[2:2 + RING]),
           tuple(jax.random.normal(k, (b, g, c, d)) for k in ks[2 + RING:]), jax.random.uniform(ks[1], (b, c)) < 0.9)
    fns = {"xla": _variant(False), "native": _variant(True)}
    outs = {k: jax.block_until_ready(f(*ops)) for k, f in fns.items()}  # compiles here
    diff = float(jnp.max(jnp.abs(outs["xla"] - outs["native"])))
    times = {k: [] for k in fns}
    for i in range(args.rounds):
      for k in (list(fns) if i % 2 == 0 else list(fns)[::-1]):
        t0 = time.perf_counter()
        for _ in range(args.calls):
          out = fns[k](*ops)
        jax.block_until_ready(out)
        times[k].append((time.perf_counter() - t0) / (args.calls * RING) * 1e6)
    ratio = statistics.median(x / n for x, n in zip(times["xla"], times["native"]))
    med = {k: statistics.median(t) for k, t in times.items()}
    rows.append((name, med["xla"], med["native"], ratio, diff))
    print(f"{name:26s} | XLA {med['xla']:8.0f} us | native {med['native']:8.0f} us | x{ratio:.2f} | "
          f"max |diff| {diff:.1e}", flush=True)
  print("\n| shape | XLA's dots | native | XLA / native | max abs diff |\n|---|---|---|---|---|")
  for name, x, n, ratio, diff in rows:
    print(f"| {name} | {x:.0f} us | {n:.0f} us | {ratio:.2f}x | {diff:.1e} |")
  if args.generate:
    gen_rows = _generate_rows(args.rounds)
    print("\n| generate (peer models, 32 x (32 + 128)) | XLA's dots | native | XLA / native |\n|---|---|---|---|")
    for label, x, n, ratio in gen_rows:
      print(f"| {label} | {x:.3f} s | {n:.3f} s | {ratio:.2f}x |")
  print(f"\nload average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
  main()
