"""Per-device XLA temporaries of a remat'd loss gradient vs layer count: unrolled / scanned, mesh context on / off."""
# Usage (8 simulated CPU devices; the scheduler flag is read when the backend starts, so run twice):
#   python benchmarks/bench_remat_memory.py
#   XLA_FLAGS=--xla_cpu_enable_concurrency_optimized_scheduler=false python benchmarks/bench_remat_memory.py
#
# Abstract compiles only (nothing allocated). Model: d_model 64, 4 heads, d_ff 128, batch 64 x 128
# tokens, fsdp=8 (8 rows per device), remat on. "context" = the compile runs under
# `jax.set_mesh(mesh)`, which turns on the residual stream's batch-sharding constraint
# (transformer.constrain_batch); without it GSPMD replicates the batch on every device.
# Measured (jax 0.10.2, XLA:CPU), temporaries MiB at 2 / 4 / 8 layers:
#   default scheduler:  unrolled 170 / 290 / 531, with context 24 / 43 / 82;
#                       scanned   87 /  87 /  88, with context 13 / 14 / 15
#   memory-optimized:   unrolled 102 / 155 / 261, with context 10 / 11 / 12;
#                       scanned   70 /  71 /  72, with context 10 / 10 / 11
# i.e. (1) the missing constraint costs ~7x here (full-batch activations per device), and (2)
# XLA:CPU's default, concurrency-optimized scheduler runs every layer's remat recompute early in
# an unrolled program, so its temporaries grow with depth; a scan's loop serializes them.
from __future__ import annotations

import dataclasses
import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import contextlib  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from rl_jax import sharding as sh  # noqa: E402
from rl_jax.models import ModelConfig, Transformer  # noqa: E402

BASE = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128,
                   tie_embeddings=False, remat=True)
B, S = 64, 128


def temp_mib(cfg: ModelConfig, mesh, context: bool) -> float:
  graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
  tok = jax.ShapeDtypeStruct((B, S), jnp.int32)

  def loss(state, tok):
    return jnp.mean(jax.nn.log_softmax(nnx.merge(graphdef, state)(tok).logits_BSV)[..., 0])

  shardings = sh.state_shardings(state, mesh)
  f = jax.jit(jax.grad(loss), in_shardings=(shardings, sh.batch_sharding(mesh)), out_shardings=shardings)
  with jax.set_mesh(mesh) if context else contextlib.nullcontext():
    return f.lower(state, tok).compile().memory_analysis().temp_size_in_bytes / 2**20


def main():
  mesh = sh.make_mesh(sh.MeshConfig(data=1, fsdp=8, expert=1, tensor=1))
  sched = ("memory-optimized" if "concurrency_optimized_scheduler=false" in os.environ.get("XLA_FLAGS", "")
           else "default")
  print(f"XLA:CPU {sched} scheduler; temporaries MiB per device at 2 / 4 / 8 layers")
  for scan in (False, True):
    for context in (False, True):
      row = [temp_mib(dataclasses.replace(BASE, n_layers=n, scan_layers=scan), mesh, context) for n in (2, 4, 8)]
      print(f"  {'scanned ' if scan else 'unrolled'} context={context!s:5}: " + " / ".join(f"{x:6.1f}" for x in row))


if __name__ == "__main__":
  main()
