"""Loss+grad time of pg vs score centering (top-k) vs tis+sc, printed as ratios against pg.

Usage (full size from the issue: B=64, T=512, V=32768, k=128; ~9 GiB of host memory on CPU):
  python benchmarks/bench_loss.py
  python benchmarks/bench_loss.py --small                 # B=8, T=128, V=8192: seconds
  python benchmarks/bench_loss.py --mode hidden --chunk 128  # logits from hidden @ W, chunked

`--mode logits` (default) times the loss alone: value_and_grad of `rl_loss` w.r.t. the
[B, T, V] logits, diagnostics included (a trainer logs them every step). `--mode hidden`
times `rl_loss_from_hidden` (matmul included), chunked over T when --chunk > 0.

Methods are timed interleaved, round by round, so a machine shared with other work slows
them alike; wall-clock median and minimum and the median process CPU time are reported (on
a busy machine the CPU time is the better estimate of the intrinsic cost).

Measured (2 shared AMD EPYC cores, load average ~8-9 from other jobs, float32, 5 rounds,
~10 min in all): full size pg 9.8 s CPU per step; CPU-time ratios sc 1.04x, tis+sc 1.05x
(wall-clock ratios swung 0.9x-1.4x with the load). Target: top-k SC within 1.10x of PG.
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from rl_jax.rl.loss.loss_config import LossConfig
from rl_jax.rl.loss.losses import rl_loss, rl_loss_from_hidden

VARIANTS = {
    "pg": dict(method="pg"),
    "sc": dict(method="pg", score_centering="topk"),
    "tis+sc": dict(method="tis", score_centering="topk"),
}


def _inputs(args):
  """Random inputs; numpy's generator, since threefry over B*T*V values takes minutes on CPU."""
  rng = np.random.default_rng(0)
  b, t, v, k = args.B, args.T, args.V, args.k
  dtype = jnp.dtype(args.dtype)
  lengths = rng.integers(t // 4, t + 1, (b, 1))
  head_q = rng.dirichlet(np.ones(k + 1), (b, t))[..., :k]
  data = dict(
      targets=rng.integers(0, v, (b, t), dtype=np.int32),
      mask=(np.arange(t)[None] < lengths).astype(np.float32),
      adv=rng.normal(size=(b,)).astype(np.float32),
      logq=(-2.0 * rng.exponential(size=(b, t))).astype(np.float32),
      # Values do not change the work done; a true top-k over V would only slow the setup.
      topk_ids=rng.integers(0, v, (b, t, k), dtype=np.int32),
      topk_logq=np.log(head_q).astype(np.float32),
  )
  if args.mode == "logits":
    data["x"] = rng.standard_normal((b, t, v), dtype=np.float32) * 2.0
  else:
    data["x"] = rng.standard_normal((b, t, args.D), dtype=np.float32)
    data["w"] = rng.standard_normal((args.D, v), dtype=np.float32) / args.D ** 0.5
  # Everything is a jit argument (as in a trainer), never a constant folded into the program.
  return {name: jnp.asarray(x, dtype if name in ("x", "w") else None)
          for name, x in data.items()}


def _step_fn(args, cfg, data):
  names = ["targets", "mask", "adv", "logq", "topk_ids", "topk_logq"]
  arrays = tuple(data[n] for n in names)

  def loss(x, w, targets, mask, adv, logq, topk_ids, topk_logq):
    kw = dict(topk_ids_BTK=topk_ids, topk_logq_BTK=topk_logq)
    if args.mode == "logits":
      return rl_loss(x, targets, mask, adv, logq, cfg, **kw)
    return rl_loss_from_hidden(x, w, targets, mask, adv, logq, cfg, chunk_size=args.chunk, **kw)

  argnums = (0,) if args.mode == "logits" else (0, 1)
  step = jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))
  return step, (data["x"], data.get("w")) + arrays


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--small", action="store_true", help="B=8, T=128, V=8192 (quick check)")
  p.add_argument("--B", type=int, default=64)
  p.add_argument("--T", type=int, default=512)
  p.add_argument("--V", type=int, default=32768)
  p.add_argument("--k", type=int, default=128)
  p.add_argument("--D", type=int, default=1024, help="hidden size for --mode hidden")
  p.add_argument("--chunk", type=int, default=0, help="T-chunk for --mode hidden (0 = none)")
  p.add_argument("--mode", choices=("logits", "hidden"), default="logits")
  p.add_argument("--dtype", default="float32", help="logits / hidden dtype")
  p.add_argument("--rounds", type=int, default=5)
  args = p.parse_args()
  if args.small:
    args.B, args.T, args.V = 8, 128, 8192
  print(f"backend={jax.default_backend()} devices={jax.device_count()} mode={args.mode} "
        f"B={args.B} T={args.T} V={args.V} k={args.k} dtype={args.dtype}"
        + (f" D={args.D} chunk={args.chunk}" if args.mode == "hidden" else ""))
  data = _inputs(args)
  steps = {}
  for name, over in VARIANTS.items():
    cfg = LossConfig(topk=args.k, **over)
    fn, xs = _step_fn(args, cfg, data)
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*xs))  # compile + first run
    steps[name] = (fn, xs)
    print(f"  compiled {name:7s} in {time.perf_counter() - t0:6.1f} s")
  wall = {name: [] for name in steps}
  cpu = {name: [] for name in steps}
  for _ in range(args.rounds):
    for name, (fn, xs) in steps.items():
      t0, c0 = time.perf_counter(), time.process_time()
      jax.block_until_ready(fn(*xs))
      wall[name].append(time.perf_counter() - t0)
      cpu[name].append(time.process_time() - c0)
  # Wall time is what a run costs; process CPU time (all threads) is the work done, and is
  # far less disturbed when other jobs share the cores.
  print(f"{'method':8s} {'wall med s':>10s} {'wall min s':>10s} {'cpu med s':>9s} "
        f"{'wall med/pg':>11s} {'wall min/pg':>11s} {'cpu med/pg':>10s}")
  med = lambda d, n: statistics.median(d[n])
  for name in steps:
    print(f"{name:8s} {med(wall, name):10.4f} {min(wall[name]):10.4f} {med(cpu, name):9.3f} "
          f"{med(wall, name) / med(wall, 'pg'):10.3f}x "
          f"{min(wall[name]) / min(wall['pg']):10.3f}x {med(cpu, name) / med(cpu, 'pg'):9.3f}x")


if __name__ == "__main__":
  main()
