"""The RL run's device state, made in one place: what the trainer holds and checkpoints, what the planner counts."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from rl_jax import train_state
from rl_jax.sampler import weights as sampler_weights

# Folded into the run's seed for the sampler's fixed weight noise (sampler.noise).
NOISE_SALT = 0x5E5


def holds_sampler_src(job) -> bool:
  """Whether the sampler refreshes from a copy of its own (`sampler_src`, the trainer's params at
  the last sync): when it lags the trainer (rl.staleness > 1) or syncs only every few steps
  (rl.sampler_sync_every > 1). A copy, since the trainer's params are donated to every update."""
  return job.rl.staleness > 1 or job.rl.sampler_sync_every > 1


def init_state(job, params, optimizer, mesh) -> dict:
  """The state one RL run holds on its devices and checkpoints, from the policy's first `params`:
  "params", "opt_state" (laid out like the params) and the `copies` of them the run keeps.
  Checkpointed whole, so a resumed sampler holds the very weights of the uninterrupted run's."""
  return {"params": params, "opt_state": train_state.init_opt_state(optimizer, params, mesh), **copies(job, params)}


def copies(job, params) -> dict:
  """The run state's params-shaped entries besides the params: "noise" (the sampler's fixed offset,
  where `sampler.noise` is on; drawn from the first weights) and "sampler_src" (`holds_sampler_src`).
  `jax.eval_shape` of it is the planner's inventory (rl_jax.plan.steps.resident_state)."""
  out = {}
  noise_key = jax.random.fold_in(jax.random.key(job.seed), NOISE_SALT)
  delta = sampler_weights.make_noise(params, job.sampler.noise, job.sampler.noise_sigma, noise_key)
  if delta is not None:
    out["noise"] = delta
  if holds_sampler_src(job):
    out["sampler_src"] = jax.tree.map(jnp.copy, params)
  return out
