"""The one factory of an RL step's jitted programs: the trainer runs them, the planner compiles them.

`build(job, mesh, graphdef, ...)` returns `StepPrograms`: the sampler's (`SamplerPrograms`, the
`Sampler` seam of rl_jax/sampler/programs.py: the weight sync, generate for the rollout and the
greedy and sampled evaluation, chunked rollouts) and the learner's (`LearnerPrograms`: the p_old
forward, the update, the first-order meter, the replay probe, the advantages), each with the
run's static configuration, shardings, donation and its role's mesh; `build_local(...)` the same
programs without a job, on one device, for notebooks (`rl_jax.explore`). Nothing else in the
package jits them.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from rl_jax import rollout as rollout_lib
from rl_jax import sharding as sh
from rl_jax.logprobs import gather_logprobs
from rl_jax.rl import mismatch_attribution as attribution_lib
from rl_jax.rl import step as step_lib
from rl_jax.rl.advantages import compute_advantages
from rl_jax.rl.loss.loss_config import LossConfig
from rl_jax.sampler import weights as sampler_weights
from rl_jax.sampler.programs import SamplerPrograms
from rl_jax.sampler.config import SamplerConfig


@functools.lru_cache(maxsize=None)
def _minibatch(mesh, start: int, stop: int):
  """Rows [start, stop) of a batch, batch-sharded (jitted). An eager slice of a batch-sharded array
  takes its rows from a few devices and comes out replicated on every device: each device would
  hold the whole mini-batch and the update would run on replicated rows, not the split the planner
  sizes (`rl_jax.plan.steps.step_args`). Cached: a new `jax.jit` object per call misses jit's cache, so every
  step would compile the slice again."""
  def one(x):
    return jax.lax.with_sharding_constraint(x, sh.batch_sharding(mesh, x.ndim)) if x.ndim else x
  return jax.jit(lambda b: jax.tree.map(one, b.slice_rows(start, stop)))


@dataclasses.dataclass(frozen=True)
class LearnerPrograms:
  """The learner's side of an RL run: its jitted programs (fields) and the host wrappers that call
  them (methods), on the trainer's `mesh`.

  `old_forward(params, batch, sampler_ids, sampler_valid)`, `update(params, opt_state, mb)`
  (donates both), `first_order(params, mb)`, `probe(params, mb, sampler_ids, sampler_valid)` and
  `advantages(rewards)` are `jax.jit`s: call them, or lower them with abstract arguments through
  the `lower_*` methods (rl_jax.plan). The step's host side is here too, so the trainer, the
  planner and the notebooks assemble one batch: `train_batch`, `forward_old`, `prepare` (p_old
  and the routing-replay choice), `minibatches`, and their abstract twins `batch_shapes`.
  `build_local`'s programs leave out what their arguments do not define (None fields).
  """
  mesh: Any
  graphdef: nnx.GraphDef | None
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
  # The loss and routing replay the batches are prepared for, and the replay probe (`probe`).
  loss_cfg: LossConfig | None = None
  replay: step_lib.Replay = "none"
  probe: Any = None
  n_minibatches: int = 1
  # The p_old forward is the update's own (`RLJob.old_in_update`): `prepare` runs none.
  old_in_update: bool = False

  def train_batch(self, ro: rollout_lib.Rollout, adv_B) -> step_lib.TrainBatch:
    """The rollout's TrainBatch before the p_old forward: the sampler's top-k rides along whenever it
    was recorded (score centering and the drift meter read it); the truncated q under
    `loss.sampling_mask='kept_set'`."""
    return step_lib.TrainBatch.from_rollout(ro, adv_B, with_topk=True, truncated=self.loss_cfg.kept_set_mask)

  def forward_old(self, params, ro: rollout_lib.Rollout, adv_B):
    """The p_old forward of `ro`'s batch at `params`: (log p_old, theta_old's own experts, the
    mismatch metrics); the sampler's expert ids ride along (R3, routing agreement)."""
    return self.old_forward(params, self.train_batch(ro, adv_B), ro.expert_ids_BSLK, ro.expert_valid_BS)

  def lower_old_forward(self, params, batch: step_lib.TrainBatch, sampler_ids_BSLK, sampler_valid_BS):
    """`old_forward` lowered for these (possibly abstract) arguments."""
    return self.old_forward.lower(params, batch, sampler_ids_BSLK, sampler_valid_BS)

  def prepare(self, params, ro: rollout_lib.Rollout, adv_B, old=None) -> tuple[step_lib.TrainBatch, dict]:
    """The TrainBatch of a global step (`train_batch`) with p_old from `forward_old` at `params` (or
    `old`, its outputs computed earlier) and the routing replay's routes (`with_replay`), and the
    p_old forward's metrics: the batch every update of the step trains on.

    Under `old_in_update` with no `old`, no forward runs: the batch is marked for the update to take
    p_old from its own forward (`step._forward_with_old`), which also reports the p_old metrics; R3
    replays the sampler's experts as always, R2 routes on its own (theta_old's experts are that
    forward's routing), and the metrics returned here are empty."""
    if old is None and self.old_in_update:
      batch = self.train_batch(ro, adv_B).replace(old_in_update=True, sampler_ids_BSLK=ro.expert_ids_BSLK,
                                                  sampler_valid_BS=ro.expert_valid_BS)
      return (self.with_replay(batch, ro, None) if self.replay == "R3" else batch), {}
    if old is None:
      old = self.forward_old(params, ro, adv_B)
    logp_old, own_ids, m = old
    return self.with_replay(self.train_batch(ro, adv_B).replace(logp_old_BT=logp_old), ro, own_ids), m

  def with_replay(self, batch: step_lib.TrainBatch, ro: rollout_lib.Rollout, own_ids_BSLK) -> step_lib.TrainBatch:
    """The routing replay's choice (`rl.routing_replay`), in this one place: R2 replays theta_old's
    own experts (`own_ids_BSLK`, from the p_old forward), R3 the sampler's (`ro`), 'none' neither."""
    if self.replay == "R2":
      return batch.replace(replay_ids_BSLK=own_ids_BSLK, replay_mask_BS=batch.valid_BS)
    if self.replay == "R3":
      return batch.replace(replay_ids_BSLK=ro.expert_ids_BSLK, replay_mask_BS=ro.expert_valid_BS)
    return batch

  def minibatches(self, batch: step_lib.TrainBatch):
    """The `rl.n_minibatches` group-aligned mini-batches of a global step's batch, in update order,
    each laid out with its rows over the mesh's batch axes like the global batch (`_minibatch`)."""
    rows = batch.rows // self.n_minibatches
    for i in range(self.n_minibatches):
      if self.n_minibatches == 1:
        yield batch
      elif self.mesh is None:
        yield batch.slice_rows(i * rows, (i + 1) * rows)
      else:
        yield _minibatch(self.mesh, i * rows, (i + 1) * rows)(batch)

  def batch_shapes(self, params, ro: rollout_lib.Rollout, adv_B) -> dict:
    """The abstract arguments of the trainer's programs for an (abstract) rollout, by `jax.eval_shape`
    over the same methods the trainer calls (nothing runs): 'old_forward' the p_old forward's batch
    (`train_batch`), 'prepared' the step's batch (`prepare`), 'minibatch' the first of its
    `minibatches`."""
    old = jax.eval_shape(self.train_batch, ro, adv_B)
    full = jax.eval_shape(lambda p, r, a: self.prepare(p, r, a)[0], params, ro, adv_B)
    return {"old_forward": old, "prepared": full, "minibatch": jax.eval_shape(lambda b: next(self.minibatches(b)), full)}

  def lower_update(self, params, opt_state, mb: step_lib.TrainBatch):
    """`update` lowered for these (possibly abstract) arguments."""
    return self.update.lower(params, opt_state, mb)

  def lower_first_order(self, params, mb: step_lib.TrainBatch):
    """`first_order` lowered for these (possibly abstract) arguments."""
    return self.first_order.lower(params, mb)


@dataclasses.dataclass(frozen=True)
class StepPrograms:
  """One RL run's programs: the sampler's (`sampler`: rl_jax.sampler.programs.SamplerPrograms, the
  `Sampler` seam) and the learner's (`learner`), each given its mesh by role (`build`), for `job`
  (None for `build_local`'s)."""
  job: Any
  sampler: SamplerPrograms
  learner: LearnerPrograms


def routing_agreement_per_layer(trainer_ids_BSLK: jax.Array, sampler_ids_BSLK: jax.Array,
                                valid_BS: jax.Array) -> jax.Array:
  """[L]: per MoE layer, the fraction of (token, slot) whose sampler expert is among the trainer's top-k."""
  hit_BSLK = jnp.any(sampler_ids_BSLK[..., :, None] == trainer_ids_BSLK[..., None, :], axis=-1)
  w_BS = valid_BS.astype(jnp.float32)
  return jnp.einsum("bslk,bs->l", hit_BSLK.astype(jnp.float32), w_BS) / jnp.maximum(
      jnp.sum(w_BS) * hit_BSLK.shape[-1], 1.0)


def probe(params, mb: step_lib.TrainBatch, sampler_ids_BSLK, sampler_valid_BS, *, graphdef, temperature):
  """log p_theta on the mini-batch's response tokens (under its replay, if any) and, per MoE layer,
  the agreement of the trainer's own routing with the sampler's (`explore.replay_trajectory`)."""
  model = nnx.merge(graphdef, params)
  kw = {}
  if mb.replay_ids_BSLK is not None:
    kw = dict(replay_ids_BSLK=mb.replay_ids_BSLK, replay_mask_BS=mb.replay_mask_BS)
  out = model(mb.tokens_BS, mb.positions_BS, mb.valid_BS, **kw)
  logp_BT = gather_logprobs(mb.response_slots(out.logits_BSV), mb.response_BT[..., None], temperature)[0][..., 0]
  # Under replay the model reports the replayed ids: the trainer's own routing needs a free forward.
  own = model(mb.tokens_BS, mb.positions_BS, mb.valid_BS) if kw else out
  return logp_BT, routing_agreement_per_layer(own.expert_ids_BSLK, sampler_ids_BSLK, sampler_valid_BS)


def _step_programs(graphdef: nnx.GraphDef, loss: LossConfig, replay: step_lib.Replay, mesh, *, fwd_n: int = 1,
                   upd_n: int = 1, optimizer=None, aux_coef: float = 0.0, param_shardings=None,
                   opt_shardings=None) -> dict:
  """The trainer-side programs of `graphdef` under `loss` (`build` and `build_local` both take them
  from here, so each is jitted in this one place): the p_old forward, the update (with an
  optimizer; donates params and optimizer state), the first-order meter and the replay probe."""
  cfg = dict(graphdef=graphdef, loss_cfg=loss)
  update = None
  if optimizer is not None:
    update = jax.jit(functools.partial(step_lib.update, **cfg, aux_coef=aux_coef, optimizer=optimizer,
                                       microbatches=upd_n, grad_shardings=param_shardings),
                     donate_argnums=(0, 1), out_shardings=(param_shardings, opt_shardings, sh.replicated(mesh)))
  return dict(
      old_forward=jax.jit(functools.partial(step_lib.old_forward, **cfg, replay=replay, microbatches=fwd_n)),
      update=update,
      first_order=jax.jit(functools.partial(step_lib.first_order, **cfg, microbatches=upd_n,
                                            grad_shardings=param_shardings)),
      probe=jax.jit(functools.partial(probe, graphdef=graphdef, temperature=loss.temperature)))


def build(job, mesh, graphdef: nnx.GraphDef, param_shardings, opt_shardings, optimizer,
          sampler_mesh=None) -> StepPrograms:
  """Every program of `job`'s RL step on `mesh` (the shardings are the params' and optimizer state's);
  rollouts are generated on `sampler_mesh` (default: `mesh`)."""
  rl = job.rl
  fwd_n, upd_n = job.microbatch_counts(mesh)
  greedy, sampled = job.sampler.eval_configs(rl.eval_temperature, rl.eval_rows_in_flight)
  attribution, variants = None, ()
  if rl.attribution_every:
    found = attribution_lib.variants(job.sampler, job.model.dtype, stale=attribution_stale(job), moe=job.model.is_moe)
    variants = tuple((name, v, sampler_weights.sampler_graphdef(job.model, v.dtype)) for name, v in found.items())
    attribution = jax.jit(functools.partial(attribution_lib.attribute, graphdef=graphdef, variant_graphs=variants,
                                            temperature=job.sampler.temperature))
  # Each role's mesh: rollouts on the sampler's devices (async RL may split them off), evaluation
  # and every learner program on the trainer's.
  sampler = SamplerPrograms(
      cfg=job.sampler, graphdef=sampler_weights.sampler_graphdef(job.model, job.sampler.dtype),
      meshes={"rollout": mesh if sampler_mesh is None else sampler_mesh, "eval": mesh},
      quant_plan=sampler_weights.quant_plan(job.model),
      # Evaluation uses the clean float32 weights whatever the sampler's dtype.
      eval_graphdef=sampler_weights.sampler_graphdef(job.model, "float32"), eval_cfg=greedy, eval_sampled_cfg=sampled)
  learner = LearnerPrograms(
      mesh=mesh, graphdef=graphdef, forward_microbatches=fwd_n, update_microbatches=upd_n, optimizer=optimizer,
      **_step_programs(graphdef, job.loss, rl.routing_replay, mesh, fwd_n=fwd_n, upd_n=upd_n, optimizer=optimizer,
                       aux_coef=job.model.router_aux_loss_coef, param_shardings=param_shardings,
                       opt_shardings=opt_shardings),
      # Laid out like the rollout's rows (as the planner's train batch is), not replicated.
      advantages=jax.jit(functools.partial(compute_advantages, group_size=rl.group_size, cfg=job.advantage),
                         out_shardings=sh.batch_sharding(mesh, 1)),
      attribution=attribution, attribution_variants=variants, loss_cfg=job.loss,
      replay=rl.routing_replay, n_minibatches=rl.n_minibatches, old_in_update=job.old_in_update())
  return StepPrograms(job=job, sampler=sampler, learner=learner)


def build_local(graphdef: nnx.GraphDef | None = None, loss: LossConfig | None = None, *, model=None,
                sampler: SamplerConfig | None = None, replay: step_lib.Replay = "none", optimizer=None,
                aux_coef: float = 0.0) -> StepPrograms:
  """`build`'s programs without a job, on a one-device mesh (notebooks: `rl_jax.explore`).

  `graphdef` + `loss` give the p_old forward (one micro-batch, routing `replay`), the first-order
  meter, the probe and, with an `optimizer`, the update (unsharded, donating as `build`'s); the
  model config `model` + `sampler` give the sampler's sync and rollout `generate`. What is not
  given stays None. Cached on its (hashable) arguments, so repeated calls reuse the compiled programs.
  """
  # Positional, so the cache key does not depend on which defaults a caller spelled out.
  return _build_local(graphdef, loss, model, sampler, replay, optimizer, float(aux_coef))


@functools.lru_cache(maxsize=64)
def _build_local(graphdef, loss, model, sampler, replay, optimizer, aux_coef) -> StepPrograms:
  mesh = sh.make_mesh(sh.MeshConfig(num_devices=1))
  progs = {}
  if graphdef is not None:
    if loss is None:
      raise ValueError("build_local: a graphdef needs its LossConfig (loss=...)")
    progs = _step_programs(graphdef, loss, replay, mesh, optimizer=optimizer, aux_coef=aux_coef)
  if sampler is not None and model is None:
    raise ValueError("build_local: a SamplerConfig needs the model's ModelConfig (model=...)")
  sampler_progs = SamplerPrograms(
      cfg=sampler, graphdef=None if sampler is None else sampler_weights.sampler_graphdef(model, sampler.dtype),
      meshes={"rollout": mesh, "eval": mesh}, quant_plan=None if model is None else sampler_weights.quant_plan(model))
  learner = LearnerPrograms(
      mesh=mesh, graphdef=graphdef, forward_microbatches=1, update_microbatches=1, optimizer=optimizer,
      old_forward=progs.get("old_forward"), update=progs.get("update"), first_order=progs.get("first_order"),
      probe=progs.get("probe"), advantages=None, loss_cfg=loss, replay=replay)
  return StepPrograms(job=None, sampler=sampler_progs, learner=learner)


def attribution_stale(job) -> bool:
  """Whether staleness is a mismatch source of the sampler's q against p_old: the sync loop's
  emulated staleness (`rl.staleness` > 1) with p_old at the latest weights."""
  return job.rl.staleness > 1 and job.rl.p_old_version == "latest"
