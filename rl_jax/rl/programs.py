"""The one factory of an RL step's jitted programs: the trainer runs them, the planner compiles them.

`build(job, mesh, graphdef, ...)` returns the sampler-weight sync, generate (rollout, greedy and
sampled evaluation), the p_old forward, the update and the first-order meter, each with the
run's static configuration, shardings and donation; nothing else in the package jits them.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
from flax import nnx

from rl_jax import microbatch
from rl_jax import sharding as sh
from rl_jax.rl import attribution as attribution_lib
from rl_jax.rl import step as step_lib
from rl_jax.rl.advantages import compute_advantages
from rl_jax.sampler import generate as gen
from rl_jax.sampler import weights as sampler_weights
from rl_jax.sampler.config import SamplerConfig


@dataclasses.dataclass(frozen=True)
class StepPrograms:
  """The jitted programs of one RL run (fields) and the host wrappers that call them (methods).

  `old_forward(params, batch, sampler_ids, sampler_valid)`, `update(params, opt_state, mb)`
  (donates both), `first_order(params, mb)` and `advantages(rewards)` are `jax.jit`s: call
  them, or `.lower(...)` them with abstract arguments (rl_jax.plan).
  """
  job: Any
  mesh: Any
  sampler_mesh: Any
  graphdef: nnx.GraphDef
  sampler_graphdef: nnx.GraphDef
  eval_graphdef: nnx.GraphDef
  eval_cfg: SamplerConfig
  eval_sampled_cfg: SamplerConfig
  forward_microbatches: int
  update_microbatches: int
  optimizer: Any
  old_forward: Any
  update: Any
  first_order: Any
  advantages: Any
  # `attribution.attribute` jitted (None with rl.attribution_every = 0) and the variants it runs.
  attribution: Any = None
  attribution_variants: tuple = ()

  # -- the sampler -------------------------------------------------------------------------

  def sync(self, params, delta):
    """Sampler weights cast(quantize(params + delta)) (`sampler_weights.sync_weights`)."""
    return sampler_weights.sync_weights(params, delta, self.job.sampler.quant, self.job.sampler.dtype)

  def lower_sync(self, params, delta):
    return sampler_weights._sync.lower(params, delta, qcfg=self.job.sampler.quant,  # pylint: disable=protected-access
                                       dtype=self.job.sampler.dtype)

  def clean_weights(self, params):
    """The float32 evaluation weights (no noise, no quantization)."""
    return sampler_weights.sync_weights(params, None, None, "float32")

  def _generate_args(self, kind: str):
    if kind == "rollout":
      return self.sampler_graphdef, self.job.sampler
    if kind == "greedy":
      return self.eval_graphdef, self.eval_cfg
    if kind == "sampled":
      return self.eval_graphdef, self.eval_sampled_cfg
    raise ValueError(f"generate kind {kind!r}: one of 'rollout', 'greedy', 'sampled'")

  def _generate_mesh(self, kind: str):
    # Rollouts run on the sampler's devices (async RL may split them off); evaluation on the trainer's.
    return self.sampler_mesh if kind == "rollout" else self.mesh

  def generate(self, state, prompts_BP, valid_BP, key, kind: str = "rollout"):
    """`kind` 'rollout' (the sampler's weights and config), 'greedy' / 'sampled' (evaluation)."""
    graphdef, cfg = self._generate_args(kind)
    return gen.generate(graphdef, state, prompts_BP, valid_BP, key, cfg, mesh=self._generate_mesh(kind))

  def lower_generate(self, state, prompts_BP, valid_BP, key, kind: str = "rollout"):
    graphdef, cfg = self._generate_args(kind)
    kv_spec = gen._resolve_kv_spec(None, cfg)  # pylint: disable=protected-access
    return gen._generate.lower(graphdef, state, prompts_BP, valid_BP, key, cfg=cfg,  # pylint: disable=protected-access
                               kv_spec=kv_spec, mesh=self._generate_mesh(kind))

  def rollout_shapes(self, state, prompts_BP, valid_BP, key):
    """The abstract Rollout of a rollout `generate` (shapes and dtypes; nothing runs)."""
    graphdef, cfg = self._generate_args("rollout")
    kv_spec = gen._resolve_kv_spec(None, cfg)  # pylint: disable=protected-access
    return jax.eval_shape(functools.partial(gen._generate, graphdef, cfg=cfg, kv_spec=kv_spec,  # pylint: disable=protected-access
                                            mesh=self.sampler_mesh), state, prompts_BP, valid_BP, key)


def eval_configs(sampler: SamplerConfig, eval_temperature: float,
                 rows_in_flight: int = 0) -> tuple[SamplerConfig, SamplerConfig]:
  """(greedy, sampled) evaluation configs: the sampler's shapes with clean float32 weights, in
  waves of `rows_in_flight` rows (0 = the sampler's `max_rows_in_flight`)."""
  greedy = dataclasses.replace(sampler, greedy=True, noise="none", noise_sigma=0.0, quant="none",
                               dtype="float32", record_topk=0, record_experts=False,
                               max_rows_in_flight=rows_in_flight or sampler.max_rows_in_flight)
  return greedy, dataclasses.replace(greedy, greedy=False, temperature=eval_temperature)


def microbatch_counts(job, mesh) -> tuple[int, int]:
  """(p_old forward, update) micro-batch counts of `rl.forward_microbatch` (rows of the whole global
  batch per forward) and `rl.update_microbatch` (rows of each mini-batch per accumulation step);
  a ConfigError names a split that does not divide the rows or the mesh's batch axes."""
  rl = job.rl
  rows = rl.prompts_per_step * rl.group_size
  div = sh.batch_divisor(mesh)
  return (microbatch.count(rows, rl.forward_microbatch, "rl.forward_microbatch", div),
          microbatch.count(rows // rl.n_minibatches, rl.update_microbatch, "rl.update_microbatch", div))


def build(job, mesh, graphdef: nnx.GraphDef, param_shardings, opt_shardings, optimizer,
          sampler_mesh=None) -> StepPrograms:
  """Every program of `job`'s RL step on `mesh` (the shardings are the params' and optimizer state's);
  rollouts are generated on `sampler_mesh` (default: `mesh`)."""
  rl = job.rl
  fwd_n, upd_n = microbatch_counts(job, mesh)
  cfg = dict(graphdef=graphdef, loss_cfg=job.loss)
  aux = dict(aux_coef=job.model.router_aux_loss_coef)
  greedy, sampled = eval_configs(job.sampler, rl.eval_temperature, rl.eval_rows_in_flight)
  attribution, variants = None, ()
  if rl.attribution_every:
    found = attribution_lib.variants(job.sampler, job.model.dtype, stale=attribution_stale(job), moe=job.model.is_moe)
    variants = tuple((name, v, sampler_weights.sampler_graphdef(job.model, v.dtype)) for name, v in found.items())
    attribution = jax.jit(functools.partial(attribution_lib.attribute, graphdef=graphdef, variant_graphs=variants,
                                            temperature=job.sampler.temperature))
  return StepPrograms(
      job=job, mesh=mesh, sampler_mesh=mesh if sampler_mesh is None else sampler_mesh, graphdef=graphdef,
      sampler_graphdef=sampler_weights.sampler_graphdef(job.model, job.sampler.dtype),
      # Evaluation uses the clean float32 weights whatever the sampler's dtype.
      eval_graphdef=sampler_weights.sampler_graphdef(job.model, "float32"),
      eval_cfg=greedy, eval_sampled_cfg=sampled, forward_microbatches=fwd_n, update_microbatches=upd_n,
      optimizer=optimizer,
      old_forward=jax.jit(functools.partial(step_lib.old_forward, **cfg, replay=rl.routing_replay,
                                            microbatches=fwd_n)),
      update=jax.jit(functools.partial(step_lib.update, **cfg, **aux, optimizer=optimizer, microbatches=upd_n,
                                       grad_shardings=param_shardings),
                     donate_argnums=(0, 1), out_shardings=(param_shardings, opt_shardings, sh.replicated(mesh))),
      first_order=jax.jit(functools.partial(step_lib.first_order, **cfg, microbatches=upd_n,
                                            grad_shardings=param_shardings)),
      # Laid out like the rollout's rows (as the planner's train batch is), not replicated.
      advantages=jax.jit(functools.partial(compute_advantages, group_size=rl.group_size, cfg=job.advantage),
                         out_shardings=sh.batch_sharding(mesh, 1)),
      attribution=attribution, attribution_variants=variants)


def attribution_stale(job) -> bool:
  """Whether staleness is a mismatch source of the sampler's q against p_old: the sync loop's
  emulated staleness (`rl.staleness` > 1) with p_old at the latest weights."""
  return job.rl.staleness > 1 and job.rl.p_old_version == "latest"
