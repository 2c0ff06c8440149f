"""An RL run's checkpoints: `save` the state (async: with the rollouts in flight), `restore` it on resume."""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from rl_jax import rollout as rollout_lib
from rl_jax import sharding as sh
from rl_jax.rl import inflight as inflight_lib
from rl_jax.rl import inflight_updates


def save(trainer, step: int) -> None:
  """`trainer`'s state at `step` and, async, the rollouts in flight (generated, not yet trained on)."""
  items = dict(trainer.state)
  meta = {"step": step, "seed": trainer.job.seed, "job": "rl"}
  if hasattr(trainer.task, "data_state"):  # the position in the data files (checked on resume)
    meta["data"] = trainer.task.data_state(step * trainer.job.rl.prompts_per_step)
  if trainer.queue:
    partial = trainer.job.rl.inflight_updates
    # In-flight updates: rollouts still in generation (`rl.inflight_resume`: their progress, or their
    # whole engine carries), else whole ones.
    form = trainer.job.rl.inflight_resume
    to_tree = (lambda it: inflight_updates.to_tree(trainer, it, form)) if partial else inflight_lib.to_tree
    items["inflight"] = {str(i): to_tree(it) for i, it in enumerate(trainer.queue)}
    meta.update(inflight_steps=[it.step for it in trainer.queue],
                inflight_versions=[it.version for it in trainer.queue])
    if partial:
      meta["inflight_advanced"] = [it.advanced for it in trainer.queue]
      meta["inflight_resume"] = form
  trainer.ckpt.save(step, items, meta)


def restore(trainer) -> tuple[dict, dict, int]:
  """(state, meta, step) of the newest checkpoint that restores into `trainer.state`'s layout (a
  corrupt newer one is moved aside: `Checkpointer.restore`); a dataset task checks its position."""
  state, meta, step = trainer.ckpt.restore(trainer.state)
  if "data" in meta and hasattr(trainer.task, "check_data_state"):
    trainer.task.check_data_state(meta["data"], step * trainer.job.rl.prompts_per_step)
  print(f"[rl] resumed from step {step} in {trainer.ckpt.directory}")
  return state, meta, step


def restore_inflight(trainer, meta: dict) -> list[inflight_lib.InFlight]:
  """The rollouts in flight saved with the restored step (their abstract layout from the programs'
  shapes: the rollout `generate` returns and, under `rl.p_old_version='rollout'`, its p_old forward)."""
  job = trainer.job
  steps, versions = meta["inflight_steps"], meta["inflight_versions"]
  _, ids, valid = trainer.prompts(steps[0])
  ids, valid = rollout_lib.repeat_prompts((ids, valid), job.rl.group_size)
  if job.rl.inflight_updates:
    return restore_partial(trainer, meta, ids, valid)
  with sh.mesh_context(trainer.sampler_mesh):
    ro = trainer.programs.sampler.rollout_shapes(trainer.sampler_state, ids, valid, jax.random.key(0))
  rewards = jax.ShapeDtypeStruct((ids.shape[0],), jnp.float32)
  old_params = trainer.state["params"] if job.rl.p_old_version == "rollout" else None
  shapes = jax.eval_shape(lambda r, w: inflight_lib.to_tree(inflight_lib.InFlight(
      0, 0, r, w, None if old_params is None else trainer.programs.learner.forward_old(
          old_params, r, trainer.programs.learner.advantages(w)))), ro, rewards)
  targets = {"inflight": {str(i): inflight_lib.target(shapes, trainer.mesh) for i in range(len(steps))}}
  items, _, _ = trainer.ckpt.restore(targets, step=trainer.start_step)
  prompt_len = job.sampler.max_prompt_len
  print(f"[rl] restored {len(steps)} rollout(s) in flight (steps {steps}, versions {versions})")
  return [inflight_lib.from_tree(items["inflight"][str(i)], s, v, prompt_len)
          for i, (s, v) in enumerate(zip(steps, versions))]


def restore_partial(trainer, meta: dict, ids, valid) -> list:
  """The rollouts in generation saved with the restored step (in-flight updates), in the form the
  checkpoint holds (`meta['inflight_resume']`; 'carry' before the key existed), whatever the config
  says now: each engine carry as it was after its last chunk ('carry'), or rebuilt from its progress
  with its KV cache re-prefilled by the sampler's weights of the resumed step ('reprefill')."""
  steps, versions, advanced = meta["inflight_steps"], meta["inflight_versions"], meta["inflight_advanced"]
  form = meta.get("inflight_resume", "carry")
  with sh.mesh_context(trainer.sampler_mesh):
    abstract = trainer.programs.sampler.rollout_carry_shapes(trainer.sampler_state, ids, valid, jax.random.key(0))
  one = inflight_updates.restore_targets(trainer, abstract, trainer.job.rl.p_old_version == "rollout", form)
  items, _, _ = trainer.ckpt.restore({"inflight": {str(i): one for i in range(len(steps))}}, step=trainer.start_step)
  t = time.perf_counter()
  out = [inflight_updates.from_tree(trainer, items["inflight"][str(i)], abstract, s, v, a, form)
         for i, (s, v, a) in enumerate(zip(steps, versions, advanced))]
  jax.block_until_ready([p.carry for p in out])
  how = (f"KV caches re-prefilled by version {trainer.start_step}'s weights in {time.perf_counter() - t:.1f} s"
         if form == "reprefill" else "whole carries")
  print(f"[rl] restored {len(steps)} rollout(s) in generation (steps {steps}, versions {versions}; {how})")
  return out
