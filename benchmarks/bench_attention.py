"""Attention forward+backward time and XLA temporaries of each implementation, printed as ratios against xla."""
# Usage:
#   python benchmarks/bench_attention.py            # S = 160, 1024, 2048 at 5120 tokens per batch
#   python benchmarks/bench_attention.py --small    # S = 160, 512 at 1280 tokens: seconds
#   python benchmarks/bench_attention.py --S 512 1024 2048 --heads 4 --kv-heads 2 --head-dim 16  # tiny model's heads
#   python benchmarks/bench_attention.py --impls xla,native --S 36 160   # which implementations (default: all CPU ones)
#
# Shapes: B = --tokens // S rows (issue 15's batch is 32 x 160 = 5120 tokens), --heads query
# heads in --kv-heads groups of head dim --head-dim (default issue 15's 8 x 32, 4 KV heads),
# float32, causal, each row left-padded by a random 0-25% of S (the trainer's layout). The
# timed function is jit(grad) of sum(sin(attention(q, k, v))) over the real queries w.r.t. q, k, v, i.e. forward
# + backward; outputs and gradients are checked to agree before timing. Temporaries are
# XLA's own count for that compiled program (`memory_analysis().temp_size_in_bytes`),
# printed next to S * S * 4 bytes (one f32 [S, S] score matrix). Rounds alternate which
# implementation goes first, so a machine shared with other work slows both alike; wall
# medians and minima and the median process CPU time are reported.
#
# Measured (jax 0.10.2, XLA:CPU, 2 shared cores, load ~1-3; flash blocks 256 x 256):
# see the table in rl_jax/ops/attention.py next to _AUTO_FLASH_MIN_SC.
from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from rl_jax.ops.attention import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q, attention


def _inputs(b: int, s: int, g: int, r: int, d: int, seed: int = 0):
  """Random float32 q / k / v and a left-padded key mask (numpy's generator)."""
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((b, s, g, r, d), dtype=np.float32)
  k = rng.standard_normal((b, s, g, d), dtype=np.float32)
  v = rng.standard_normal((b, s, g, d), dtype=np.float32)
  pad = rng.integers(0, s // 4 + 1, (b, 1))
  valid = np.arange(s)[None] >= pad
  return tuple(jnp.asarray(x) for x in (q, k, v, valid))


def _step(impl: str, block_q: int, block_k: int):
  def loss(q, k, v, valid):
    # Only queries that see a key: a left-padding query's value is never read (and differs by impl).
    out_BSGRD = attention(q, k, v, valid, impl=impl, block_q=block_q, block_k=block_k)
    return jnp.sum(jnp.where(valid[:, :, None, None, None], jnp.sin(out_BSGRD), 0.0))
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def bench(s: int, args) -> dict:
  b = max(1, args.tokens // s)
  g, r, d = args.kv_heads, args.heads // args.kv_heads, args.head_dim
  xs = _inputs(b, s, g, r, d)
  fns, temps = {}, {}
  for impl in args.impls:
    t0 = time.perf_counter()
    compiled = _step(impl, args.block_q, args.block_k).lower(*xs).compile()
    temps[impl] = compiled.memory_analysis().temp_size_in_bytes
    fns[impl] = compiled
    print(f"  S={s:5d} B={b:3d} compiled {impl:7s} in {time.perf_counter() - t0:5.1f} s, "
          f"temporaries {temps[impl] / 2**20:8.2f} MiB")
  want = fns["xla"](*xs)
  for impl in args.impls[1:]:
    for a, w in zip(fns[impl](*xs), want):
      np.testing.assert_allclose(a, w, rtol=0, atol=1e-4 * max(1.0, float(jnp.max(jnp.abs(w)))), err_msg=impl)
  wall = {n: [] for n in fns}
  cpu = {n: [] for n in fns}
  for i in range(args.rounds):
    for name in (list(fns) if i % 2 == 0 else list(fns)[::-1]):
      t0, c0 = time.perf_counter(), time.process_time()
      jax.block_until_ready(fns[name](*xs))
      wall[name].append(time.perf_counter() - t0)
      cpu[name].append(time.process_time() - c0)
  return dict(b=b, temps=temps, wall=wall, cpu=cpu)


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--small", action="store_true", help="S = 160, 512 at 1280 tokens, 3 rounds (quick check)")
  p.add_argument("--S", type=int, nargs="+", default=[160, 1024, 2048])
  p.add_argument("--tokens", type=int, default=5120, help="B = tokens // S")
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--kv-heads", type=int, default=4)
  p.add_argument("--head-dim", type=int, default=32)
  p.add_argument("--block-q", type=int, default=DEFAULT_BLOCK_Q)
  p.add_argument("--block-k", type=int, default=DEFAULT_BLOCK_K)
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--impls", default="xla,blocked,native", help="comma-separated; xla is always timed (the baseline)")
  args = p.parse_args()
  args.impls = ["xla"] + [i for i in args.impls.split(",") if i and i != "xla"]
  if args.small:
    args.S, args.tokens, args.rounds = [160, 512], 1280, 3
  print(f"backend={jax.default_backend()} heads={args.heads} kv_heads={args.kv_heads} head_dim={args.head_dim} "
        f"tokens={args.tokens} blocked's blocks {args.block_q} x {args.block_k}, fwd+bwd, float32")
  rows = [(s, bench(s, args)) for s in args.S]
  med = statistics.median
  print(f"{'S':>5s} {'B':>3s} {'impl':7s} {'wall med s':>10s} {'wall min s':>10s} {'cpu med s':>9s} "
        f"{'temp MiB':>9s} {'S*S*4 MiB':>9s} {'wall/xla':>8s} {'cpu/xla':>7s} {'temp/xla':>8s}")
  for s, res in rows:
    for name in args.impls:
      w, c, t = res["wall"][name], res["cpu"][name], res["temps"][name]
      print(f"{s:5d} {res['b']:3d} {name:7s} {med(w):10.4f} {min(w):10.4f} {med(c):9.3f} {t / 2**20:9.2f} "
            f"{s * s * 4 / 2**20:9.2f} {med(w) / med(res['wall']['xla']):7.3f}x "
            f"{med(c) / med(res['cpu']['xla']):6.3f}x {t / res['temps']['xla']:7.4f}x")


if __name__ == "__main__":
  main()
