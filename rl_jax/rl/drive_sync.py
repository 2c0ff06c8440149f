"""The sync loop's global step: generate, score, train, then sync the sampler (every `rl.staleness` steps)."""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp


def step(trainer, step_index: int) -> dict:
  """One sync step of `trainer` (an `RLTrainer`, whose `rollout`, `produce`, `train_on` and
  `sync_sampler` are the pieces); its metrics row with `time/sync_s`."""
  t0 = time.perf_counter()
  problems, ro = trainer.rollout(step_index)
  item = trainer.produce(step_index, step_index, problems, ro)
  t1 = time.perf_counter()
  row = trainer.train_on(item, t0, t1)
  t3 = time.perf_counter()
  if (step_index + 1) % trainer.job.rl.staleness == 0:
    if "sampler_src" in trainer.state:
      trainer.state["sampler_src"] = jax.tree.map(jnp.copy, trainer.state["params"])
    trainer.sync_sampler()
    jax.block_until_ready(trainer.sampler_state)
    trainer.busy.observed("sampler", trainer.sampler_state)
  row["time/sync_s"] = time.perf_counter() - t3
  return row
