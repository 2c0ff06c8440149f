"""Seed-runs per hour: S seeds vmapped into one program (rl_jax/rl/seed_batch.py) vs S separate runs.

  PYTHONPATH=. python benchmarks/bench_seed_batch.py [--seeds 8] [--dense] [--small]

At the studies' size (the tiny MoE of configs/countdown_tiny.py, 16 prompts x 8, random init,
fp32 sampler) it times one step's three programs, generate / p_old forward / update, for one seed
and for S vmapped seeds (median of 5 after a warm-up, one process, so both share the allocator
and the box's load) and prints the vmapped cost per seed as a ratio of the single seed's: < 1
means seed batching wins. The host work per seed (reward parsing, metrics) is the same either way
and is left out.

Measured (2-core box, 2026-12-02, two background study jobs running at nice 10, tcmalloc absent):
see docs/performance.md#seeds-in-one-program.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from rl_jax import rollout as rollout_lib
from rl_jax.configs import countdown_tiny
from rl_jax.rl import seed_batch
from rl_jax.rl.trainer import RLTrainer


def _median(fn, n: int = 5) -> float:
  jax.block_until_ready(fn())
  ts = []
  for _ in range(n):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    ts.append(time.perf_counter() - t0)
  return statistics.median(ts)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--seeds", type=int, default=8)
  ap.add_argument("--dense", action="store_true", help="the dense tiny model instead of the MoE")
  ap.add_argument("--small", action="store_true", help="4 prompts x 2 (a smoke run)")
  args = ap.parse_args()
  cfg = countdown_tiny.get_config()
  cfg.warm_start.source, cfg.sampler.quant, cfg.logging.wandb_mode = "none", "none", "disabled"
  cfg.rl.prompts_per_step, cfg.rl.group_size = (4, 2) if args.small else (16, 8)
  cfg.optim.name, cfg.optim.schedule, cfg.optim.lr, cfg.optim.grad_clip, cfg.optim.warmup_steps = (
      "sgd", "constant", 0.1, 0.0, 0)
  if args.dense:
    cfg.model.n_experts, cfg.model.mlp_only_layers, cfg.model.router_aux_loss_coef = 0, (), 0.0
    cfg.sampler.record_experts = False
  tr = RLTrainer(cfg, tempfile.mkdtemp())
  s = args.seeds
  progs = seed_batch.vmapped(tr.programs)
  _, ids, valid = tr.prompts(0)
  ids, valid = rollout_lib.repeat_prompts((ids, valid), cfg.rl.group_size)
  ids, valid = jnp.asarray(ids, jnp.int32), jnp.asarray(valid, bool)
  key = jax.random.key(0)
  ro = tr.programs.sampler.generate(tr.sampler_state, ids, valid, key)
  rewards = np.random.default_rng(0).binomial(1, 0.3, ids.shape[0]).astype(np.float32)
  batch, _ = tr.prepare(ro, rewards)
  many = lambda t: seed_batch.stack([t] * s)
  ss, params, opt, batches = many(tr.sampler_state), many(tr.state["params"]), many(tr.state["opt_state"]), many(batch)
  sids = None if ro.expert_ids_BSLK is None or not tr.job.model.is_moe else many(ro.expert_ids_BSLK)
  svalid = many(ro.expert_valid_BS)
  rows = {
      "generate": (lambda: tr.programs.sampler.generate(tr.sampler_state, ids, valid, key),
                   lambda: progs["generate"](ss, many(ids), many(valid), jax.random.split(key, s))),
      "p_old forward": (lambda: tr.programs.learner.old_forward(tr.state["params"], batch, ro.expert_ids_BSLK if sids is not None else None,
                                                        ro.expert_valid_BS),
                        lambda: progs["old_forward"](params, batches, sids, svalid)),
  }
  # The updates donate their inputs: both time fresh copies (the copy is the same share of each).
  copy = lambda t: jax.tree.map(jnp.copy, t)
  rows["update"] = (lambda: tr.programs.learner.update(copy(tr.state["params"]), copy(tr.state["opt_state"]), batch),
                    lambda: progs["update"](copy(params), copy(opt), batches))
  print(f"seed batching, {'dense' if args.dense else 'MoE'} tiny model, {ids.shape[0]} responses per seed, "
        f"{s} seeds; backend {jax.default_backend()}, {jax.device_count()} device(s)")
  print(f"{'program':16s} {'1 seed s':>10s} {f'{s} vmapped s':>14s} {'per seed / alone':>18s}")
  tot1 = totn = 0.0
  for name, (one, vm) in rows.items():
    t1, tn = _median(one), _median(vm)
    tot1, totn = tot1 + t1, totn + tn
    print(f"{name:16s} {t1:10.4f} {tn:14.4f} {tn / s / t1:17.2f}x")
  print(f"{'step (sum)':16s} {tot1:10.4f} {totn:14.4f} {totn / s / tot1:17.2f}x   "
        f"-> seed-runs per hour x{tot1 * s / totn:.2f} with seed batching")
  tr.close()


if __name__ == "__main__":
  main()
