"""Compile time of the model's forward+backward vs layer count: unrolled layers vs `scan_layers`."""
# Usage:
#   python benchmarks/bench_scan_compile.py                  # 2, 4, 8, 16 layers; dense and MoE
#   python benchmarks/bench_scan_compile.py --layers 2 4 --kind moe
#
# The timed program is jit(value_and_grad(next-token NLL + aux)) of a small Qwen3 (d_model
# 64, 4 heads, B=2, S=32, float32, remat on as in the pod configs) lowered on abstract
# inputs and compiled ahead of time; lowering (tracing) and XLA compile are timed
# separately, best of --repeats (each repeat rebuilds the lowering, so no jit cache hits).
# The model is tiny on purpose: compile time grows with the program's size in layers, not
# with the width, and a small width keeps the measurement about the graph. An unrolled
# program holds one copy of every layer's ops, so its compile time grows about linearly in
# depth; a scanned one holds one layer body per layer group, so it stays flat.
#
# Measured once (repeats=1) on 2 CPU cores shared with ~15 other processes (load ~17), so
# every figure is inflated and noisy; compare within a row. Compile seconds, unrolled / scanned:
#   dense  2: 31.7 / 39.9 (0.8x)   4: 46.0 / 44.3 (1.0x)   8: 49.7 / 51.2 (1.0x)  16: 91.5 / 42.1 (2.2x)
#   moe    2: 72.9 / 68.9 (1.1x)   4: 69.4 / 52.5 (1.3x)   8: 112.1 / 56.6 (2.0x) 16: 103.0 / 30.0 (3.4x)
# Lowering (tracing) at 16 layers: dense 38.8 / 3.0 s, MoE 39.3 / 0.9 s.
from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
from flax import nnx

from rl_jax.models import ModelConfig, Transformer


def _config(kind: str, n_layers: int, scan: bool) -> ModelConfig:
  moe = dict(n_experts=8, n_experts_per_tok=2, moe_d_ff=32, router_aux_loss_coef=0.01) if kind == "moe" else {}
  return ModelConfig(vocab_size=256, d_model=64, n_layers=n_layers, n_heads=4, n_kv_heads=2, head_dim=16,
                     d_ff=128, remat=True, scan_layers=scan, **moe)


def _compile_seconds(cfg: ModelConfig, batch: int, seq: int, repeats: int) -> tuple[float, float]:
  """(lower seconds, compile seconds), each the best of `repeats` fresh lowerings."""
  abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)

  def loss(state, tok):
    out = nnx.merge(graphdef, state)(tok)
    logp = jax.nn.log_softmax(out.logits_BSV[:, :-1])
    return -jnp.take_along_axis(logp, tok[:, 1:, None], -1).mean() + out.aux_loss

  best_lower, best_compile = float("inf"), float("inf")
  for _ in range(repeats):
    step = jax.jit(jax.value_and_grad(loss))  # a fresh jit: no cached lowering
    t0 = time.perf_counter()
    lowered = step.lower(state, tokens)
    t1 = time.perf_counter()
    lowered.compile()
    t2 = time.perf_counter()
    best_lower, best_compile = min(best_lower, t1 - t0), min(best_compile, t2 - t1)
  return best_lower, best_compile


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8, 16])
  parser.add_argument("--kind", choices=["dense", "moe", "both"], default="both")
  parser.add_argument("--batch", type=int, default=2)
  parser.add_argument("--seq", type=int, default=32)
  parser.add_argument("--repeats", type=int, default=2)
  args = parser.parse_args()
  kinds = ["dense", "moe"] if args.kind == "both" else [args.kind]
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}; forward+backward, remat, "
        f"B={args.batch} S={args.seq}; seconds, best of {args.repeats}")
  print(f"{'kind':6s} {'layers':>6s} | {'unrolled lower':>14s} {'compile':>8s} | "
        f"{'scanned lower':>13s} {'compile':>8s} | {'compile ratio':>13s}")
  for kind in kinds:
    for n in args.layers:
      base = _config(kind, n, scan=False)
      ul, uc = _compile_seconds(base, args.batch, args.seq, args.repeats)
      sl, sc = _compile_seconds(dataclasses.replace(base, scan_layers=True), args.batch, args.seq,
                                args.repeats)
      print(f"{kind:6s} {n:6d} | {ul:14.2f} {uc:8.2f} | {sl:13.2f} {sc:8.2f} | {uc / sc:12.1f}x")


if __name__ == "__main__":
  main()
