"""The async loop's global step: step s trains the rollout generated at version s - K while the sampler generates s + K."""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from rl_jax.rl import inflight as inflight_lib


def step(trainer, step_index: int) -> dict:
  """One async step of `trainer` (an `RLTrainer`, whose `rollout`, `produce`, `train_on`,
  `sync_sampler` and `queue` of rollouts in flight are the pieces); its metrics row.

  Order of dispatch: the sampler's weights of version s (before update s donates the params),
  the generation of step s + K on the sampler's devices, then the trainer's p_old forward and
  updates on its own; only then does the host wait for the new tokens and score them.

  `rl.stale_policy='drop'` with `rl.sampler_sync_every = S > 1`: the sampler refreshes its
  weights only at the start of every S-th step and otherwise generates with the ones it holds
  (no wait for the trainer), so a rollout can arrive more than K versions behind; at the step
  that would train it such a rollout is dropped and its prompts regenerated, before anything
  else, with the trainer's current weights (docs/architecture.md#asynchronous-rl).
  """
  rl, state = trainer.job.rl, trainer.state
  k, every = rl.max_staleness, rl.sampler_sync_every
  p_old_at_rollout = rl.p_old_version == "rollout"
  t0 = time.perf_counter()
  if not trainer.queue:  # a fresh run: steps 0..K-1 come from the initial weights (version 0)
    for s in range(step_index, min(step_index + k, rl.steps)):
      problems, ro = trainer.rollout(s)
      trainer.queue.append(trainer.produce(s, step_index, problems, ro,
                                           state["params"] if p_old_at_rollout else None))
  item = trainer.queue.popleft()
  assert item.step == step_index, (item.step, step_index)
  dropped = waits = 0
  fresh = None  # the weights of version `step_index`, when a regeneration already made them
  if inflight_lib.is_stale(item.lag, k):  # only under 'drop': 'wait' never lets the lag pass K
    dropped, (item, fresh) = 1, regenerate(trainer, step_index)
    waits += 1
  ahead = step_index + k
  keep = None
  if ahead < rl.steps:
    if step_index % every == 0:  # every step under 'wait'
      if "sampler_src" in state:
        state["sampler_src"] = jax.tree.map(jnp.copy, state["params"])
      if fresh is None:
        trainer.sync_sampler()  # version `step_index`
      else:  # the same params, synced once already (bit for bit what sync_sampler would make)
        trainer.sampler_state = fresh
      waits += 1
    if p_old_at_rollout:  # the params of the version generating step + K, for its p_old
      keep = (state["sampler_src"] if "sampler_src" in state
              else jax.tree.map(jnp.copy, state["params"]))  # update donates the params
    ahead_rollout = trainer.rollout(ahead)
  t1 = time.perf_counter()
  row = trainer.train_on(item, t0, t1)
  t3 = time.perf_counter()
  if ahead < rl.steps:
    version = inflight_lib.pipeline_version(step_index, every)
    trainer.queue.append(trainer.produce(ahead, version, *ahead_rollout, keep))
  # The host's wait for the sampler after the trainer finished (0 when generation kept up).
  row["time/sampler_wait_s"] = time.perf_counter() - t3
  row["async/dropped"], row["async/waits"] = float(dropped), float(waits)
  return row


def regenerate(trainer, step_index: int):
  """The rollout of `step_index` (its prompts and key) again, from the trainer's current weights, and
  those sampler weights: a one-off sync that leaves the sampler's own weights, and their refresh
  schedule, as they were. Waited for here, so the sampler's devices hold nothing else yet."""
  params = trainer.state["params"]
  weights = trainer.weights_for_sampler(params)
  problems, ro = trainer.rollout(step_index, weights)
  item = trainer.produce(step_index, step_index, problems, ro,
                         params if trainer.job.rl.p_old_version == "rollout" else None)
  return item, weights
