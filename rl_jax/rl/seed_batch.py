"""Seeds batched into one program: the RL step's programs vmapped over a leading seed axis.

`stack` puts S runs' pytrees (params, optimizer state, sampler weights, batches, keys) on a
leading axis; `vmapped(programs)` returns the step programs of `rl_jax.rl.programs` mapped over
it (generate, p_old forward, update), so S seeds of one cell advance in one dispatch. Each seed's
numbers equal its own run's to float32 rounding (batched matmuls block their reductions
differently: `tests/test_seed_batch.py`). Whether it pays depends on the device:
`benchmarks/bench_seed_batch.py` measures seed-runs per hour against separate runs (on 2 CPU cores
at the studies' size it does not, which is why the study runner launches seeds as separate
processes; the numbers are in docs/performance.md).
"""
from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp

from rl_jax.rl import step as step_lib
from rl_jax.sampler import generate as gen
from rl_jax.sampler.xla_options import sampler_jit


def stack(trees: Sequence[Any]) -> Any:
  """S pytrees of the same structure -> one with a leading seed axis."""
  return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def unstack(tree: Any, n: int) -> list[Any]:
  """Inverse of `stack`: the n per-seed pytrees."""
  return [jax.tree.map(lambda x, i=i: x[i], tree) for i in range(n)]


def vmapped(programs) -> dict[str, Any]:
  """Jitted, seed-vmapped versions of a run's `StepPrograms`: {'generate', 'old_forward', 'update'}.

  generate(states, prompts_SBP, valid_SBP, keys_S); old_forward(params_S, batch_S, ids_S, valid_S);
  update(params_S, opt_S, batch_S) (donating both). Weights and optimizer state are per seed
  (no leaf is shared), the mesh is not used: one device holds every seed.
  """
  job = programs.job
  kv_spec = gen.resolve_kv_spec(None, job.sampler)
  generate = functools.partial(gen.generate_program, programs.sampler.graphdef, cfg=job.sampler,
                               kv_spec=kv_spec, mesh=None)
  cfg = dict(graphdef=programs.learner.graphdef, loss_cfg=job.loss)
  old = functools.partial(step_lib.old_forward, **cfg, replay=job.rl.routing_replay,
                          microbatches=programs.learner.forward_microbatches)
  update = functools.partial(step_lib.update, **cfg, aux_coef=job.model.router_aux_loss_coef,
                             optimizer=programs.learner.optimizer, microbatches=programs.learner.update_microbatches)
  return {"generate": sampler_jit(jax.vmap(generate)), "old_forward": jax.jit(jax.vmap(old)),
          "update": jax.jit(jax.vmap(update), donate_argnums=(0, 1))}
