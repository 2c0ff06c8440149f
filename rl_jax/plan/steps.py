"""One RL step's programs lowered and compiled for a job on a mesh: the trainer's own jitted
programs (`rl.programs.build`) over abstract state and batches derived from them."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from rl_jax import microbatch
from rl_jax import sharding as sh
from rl_jax.optim import make_optimizer
from rl_jax.plan import hw
from rl_jax.plan.config import PROGRAMS, default_programs
from rl_jax.plan.cost import ProgramPlan, attn_flops, compile_program, dispatch_comm, extrapolate, matmul_params
from rl_jax.plan.state import (abstract_opt_state, abstract_params, device_bytes, kv_cache_sizing,
                               opt_state_like_params, sds)
from rl_jax.rl import programs as programs_lib
from rl_jax.rl import run_state


def plan_step(job, mesh, programs: tuple[str, ...] | None = None, group: str = "") -> list[ProgramPlan]:
  """Lowers and compiles `programs` (default: those `job`'s trainer runs, `default_programs`) for `job`
  on `mesh`.

  `group` 'sampler' / 'trainer': async RL on split devices (`mesh.sampler_devices`), where each
  group's devices hold only their own state (the sampler's weights, or the trainer's params and
  optimizer state); '' (default): both on every device.

  Inside `jax.set_mesh(mesh)`: the model reads the context mesh while tracing, for the
  `shard_map` MoE dispatch and for the batch-sharding constraint on its residual stream
  (`transformer.constrain_batch`).
  """
  with jax.set_mesh(mesh):
    return _plan_step(job, mesh, default_programs(job) if programs is None else programs, group)


def _plan_step(job, mesh, programs: tuple[str, ...] = PROGRAMS, group: str = "") -> list[ProgramPlan]:
  mcfg, scfg, rl = job.model, job.sampler, job.rl
  graphdef, params = abstract_params(mcfg, mesh)
  optimizer = make_optimizer(job.optim)
  opt_state = abstract_opt_state(optimizer, params, mesh)
  b_global = rl.prompts_per_step * rl.group_size
  div = sh.batch_divisor(mesh)
  if not group:  # split groups: `run` checked the trainer's and the sampler's meshes together
    job.check_mesh(mesh)
  # The trainer's own programs (rl_jax/rl/programs.py): the planner lowers exactly what runs.
  progs = programs_lib.build(job, mesh, graphdef, jax.tree.map(lambda x: x.sharding, params),
                             jax.tree.map(lambda x: x.sharding, opt_state), optimizer)
  b_dev = b_global / div
  p, t = scfg.max_prompt_len, scfg.max_new_tokens
  s = p + t
  n_params, n_opt = device_bytes(params), device_bytes(opt_state)
  n_opt_like = device_bytes(opt_state_like_params(opt_state, params))
  if n_opt > n_opt_like:
    print(f"[plan] warning: the optimizer state takes {hw.gib(n_opt)} per device as "
          f"train_state.init_opt_state lays it out (moments not sharded like their params); sharded like "
          f"the params it would take {hw.gib(n_opt_like)}. The figures below are today's layout.")
  state = resident_state(job, params)
  delta = state.get("noise")
  trainer_extra = {RESIDENT_NAMES[k]: device_bytes(v) for k, v in state.items()}
  if rl.mode == "async" and rl.p_old_version == "rollout":
    trainer_extra["params copy (p_old at the rollout's version)"] = n_params
  plans = []

  # Sampler weights: cast(quantize(params + Delta)), the trainer's sync program.
  sync = ProgramPlan("sync", args={"params": n_params, **({"noise": trainer_extra["sampler noise"]}
                                                          if delta is not None else {})},
                     resident={"optimizer state": n_opt})
  lowered = progs.sampler.lower_sync(params, delta)
  compiled = compile_program(sync, lowered)
  sampler_state = jax.tree.map(sds, lowered.out_info, compiled.output_shardings)
  n_sampler = device_bytes(sampler_state)
  sync.bytes_model = n_params + n_sampler
  plans.append(sync)
  if group == "sampler":   # its devices hold the sampler's weights and the params copied in to sync
    sync.resident, trainer_extra = {}, {}
  elif group == "trainer":  # the sampler's weights live on the other group
    n_sampler = 0
  mm = matmul_params(mcfg)

  def plan_generate(name: str, kind: str, rows: int, state, n_state: int, cfg) -> None:
    """Generate (prefill + decode loop over a static KV cache) of `rows` prompts, one wave of
    `cfg.max_rows_in_flight` rows at a time."""
    prompts, pvalid, key = prompt_args(rows, p, mesh)
    g = ProgramPlan(name, args={"sampler weights": n_state, "batch": device_bytes((prompts, pvalid, key))},
                    resident={} if group == "sampler" else {
                        "params": n_params, "optimizer state": n_opt, **trainer_extra,
                        **({"sampler weights": n_sampler} if kind != "rollout" and n_sampler else {})})
    n_waves = microbatch.count(rows, cfg.max_rows_in_flight, "sampler.max_rows_in_flight", div)
    kv_spec = None if kind != "rollout" else getattr(cfg.quant, "kv", None)
    cache_rows = rows // n_waves
    g.engine = f"static, {n_waves} wave(s) of {cache_rows} rows"
    if cfg.engine == "continuous":  # one S-slot cache region per slot, whatever the rows
      cache_rows = cfg.slots_for(rows, div)
      g.engine = (f"continuous, {cache_rows} slots for {rows} rows, refill prefill chunks of "
                  f"{min(cfg.prefill_chunk, p - 1)} prompt slots")
      if kind == "rollout" and rl.inflight_updates:
        g.engine += (f"; in-flight weight updates every {rl.inflight_chunk} iterations, "
                     f"{rl.max_staleness} rollouts in generation")
    phases = [slots for _, slots in cfg.phase_bounds()]
    if len(phases) > 1:  # the phases' cache copies are part of `temp` (sampler.decode_phases)
      held = ("each held beside the whole cache while its phase runs" if cfg.engine == "continuous"
              else "grown between phases")
      g.engine += (f"; decode phases reading {', '.join(map(str, phases))} cache slots ({held}; "
                   "sampler.decode_phases=1 drops them)")
    g.kv_cache, g.kv_cache_sizing = kv_cache_sizing(mcfg, cfg, cache_rows, kv_spec if getattr(
        kv_spec, "format", None) not in (None, "fp32") else None, mesh)
    compile_program(g, progs.sampler.lower_generate(state, prompts, pvalid, key, kind))
    if kind == "rollout" and rl.inflight_updates and rl.max_staleness > 1:
      # The other rollouts in generation keep their carries (KV cache and the rows' buffers, about
      # generate's outputs) on the sampler's devices between their chunks.
      g.resident["other rollouts in generation"] = (rl.max_staleness - 1) * (g.kv_cache + g.output)
    r_dev = rows / div
    g.flops_model = (2 * mm * r_dev * (p - 1) + attn_flops(mcfg, r_dev * (p - 1), p / 2)
                     + t * (2 * mm * r_dev + attn_flops(mcfg, r_dev, s)))
    # Every decode step of every wave reads the weights; each wave's steps read its cache.
    g.bytes_model = (t + 1) * (n_waves * n_state + n_waves * g.kv_cache)
    sjob = dataclasses.replace(job, model=dataclasses.replace(mcfg, dtype=cfg.dtype))
    g.comm_model = dispatch_comm(sjob, mesh, r_dev * (p - 1 + t))
    plans.append(g)

  if "generate" in programs:
    plan_generate("generate", "rollout", b_global, sampler_state, n_sampler, scfg)
  clean = None
  for name, kind, rows, cfg in (("eval_greedy", "greedy", rl.eval_size, progs.sampler.eval_cfg),
                                ("eval_sampled", "sampled", rl.eval_size * rl.eval_samples, progs.sampler.eval_sampled_cfg)):
    if name in programs and rows:  # rl.eval_size = 0: no evaluation, nothing to plan
      if clean is None:
        clean = jax.tree.map(sds, *_lowered_out(progs.sampler.clean_weights, params))
      plan_generate(name, kind, rows, clean, device_bytes(clean), cfg)

  # The train batch: `jax.eval_shape` of the trainer's own assembly (`LearnerPrograms.batch_shapes`)
  # over the rollout the sampler's generate returns, laid out like the rollout (rows over the batch
  # axes); the sampler's expert ids (compact: uint8 up to 256 experts) ride along.
  if not {"old_forward", "update", "first_order"} & set(programs):
    return [q for q in plans if q.name in programs]
  batch_args = step_args(progs, params, sampler_state, mesh)
  batch, sampler_ids, sampler_valid = batch_args["old_forward"]
  old = ProgramPlan("old_forward", args={"params": n_params,
                                         "batch": device_bytes((batch, sampler_ids, sampler_valid))},
                    resident={"optimizer state": n_opt, **({"sampler weights": n_sampler} if n_sampler else {}),
                              **trainer_extra})
  if "old_forward" in programs:
    compile_program(old, progs.learner.lower_old_forward(params, batch, sampler_ids, sampler_valid))
    old.flops_model = 2 * mm * b_dev * s + attn_flops(mcfg, b_dev * s, s / 2)
    old.comm_model = dispatch_comm(job, mesh, b_dev * s)
    plans.append(old)

  rows = b_global // rl.n_minibatches
  full, (mb,) = batch_args["prepared"], batch_args["update"]
  n_mb, n_full = device_bytes(mb), device_bytes(full)
  fwd_flops = 2 * mm * (rows / div) * s + attn_flops(mcfg, (rows / div) * s, s / 2)
  # Forward-equivalents of each program (a backward pass ~ 2 forwards): the update is one forward and
  # one backward, the meter one forward and two pullbacks; remat adds a forward per backward.
  passes = {"update": (3, 4), "first_order": (5, 7)}
  for name in ("update", "first_order"):
    if name not in programs:
      continue
    args = {"params": n_params, "batch": n_mb}
    resident = {**({"sampler weights": n_sampler} if n_sampler else {}), **trainer_extra,
                **({"rest of the global batch": n_full - n_mb} if n_full > n_mb else {})}
    if name == "update":
      args["optimizer state"] = n_opt
      lowered = progs.learner.lower_update(params, opt_state, mb)
    else:   # the meter reads the params before the update: the optimizer state stays resident
      resident["optimizer state"] = n_opt
      lowered = progs.learner.lower_first_order(params, mb)
    q = ProgramPlan(name, args=args, resident=resident)
    compile_program(q, lowered)
    q.flops_model = fwd_flops * passes[name][1 if mcfg.remat else 0]
    # A backward moves what the forward did; remat replays the forward's dispatch.
    n_bwd = 1 if name == "update" else 2
    q.comm_model = dispatch_comm(job, mesh, (rows / div) * s) * (1 + n_bwd * (2 if mcfg.remat else 1))
    plans.append(q)
  return [q for q in plans if q.name in programs]


# The run state's copies of the params (`rl.run_state.copies`), as the tables name them.
RESIDENT_NAMES = {"noise": "sampler noise", "sampler_src": "sampler_src copy"}


def resident_state(job, params) -> dict:
  """The trainer's run state beyond its params and optimizer state (`rl.run_state.copies`) as
  abstract arrays laid out like the params, by `jax.eval_shape` over `params`: the planner counts
  what the trainer holds, not a list of its own."""
  state = jax.eval_shape(lambda p: run_state.copies(job, p), params)
  return {k: jax.tree.map(lambda x, p: sds(x, p.sharding), v, params) for k, v in state.items()}


def prompt_args(rows: int, prompt_len: int, mesh):
  """Abstract (prompts_BP, valid_BP, key) of a `generate` over `rows` prompts, rows over the batch axes."""
  prompts = sds(jax.ShapeDtypeStruct((rows, prompt_len), jnp.int32), sh.batch_sharding(mesh, 2))
  pvalid = sds(jax.ShapeDtypeStruct((rows, prompt_len), jnp.bool_), sh.batch_sharding(mesh, 2))
  return prompts, pvalid, sds(jax.eval_shape(lambda: jax.random.key(0)), sh.replicated(mesh))


def step_args(progs, params, sampler_state, mesh) -> dict:
  """The abstract batch arguments of the trainer's programs, derived (not built): the rollout is
  `jax.eval_shape` of the sampler's generate over the step's prompts, the batches are
  `LearnerPrograms.batch_shapes` of it (the trainer's own `train_batch`, `prepare`, `minibatches`).
  'old_forward': (batch, sampler expert ids, their valid mask); 'prepared': the step's batch;
  'update' / 'first_order': (mini-batch,). Every array is laid out like the rollout's rows."""
  rl, scfg = progs.job.rl, progs.job.sampler
  rows = rl.prompts_per_step * rl.group_size
  ro = progs.sampler.rollout_shapes(sampler_state, *prompt_args(rows, scfg.max_prompt_len, mesh))
  shapes = progs.learner.batch_shapes(params, ro, jax.ShapeDtypeStruct((rows,), jnp.float32))
  rows_sharded = lambda tree: jax.tree.map(lambda x: sds(x, sh.batch_sharding(mesh, x.ndim)), tree)
  old = rows_sharded((shapes["old_forward"], ro.expert_ids_BSLK, ro.expert_valid_BS))
  mb = rows_sharded(shapes["minibatch"])
  return {"old_forward": old, "prepared": rows_sharded(shapes["prepared"]), "update": (mb,), "first_order": (mb,)}


def _lowered_out(fn, *args):
  """(ShapeDtypeStructs, shardings) of jitted `fn`'s outputs, compiled abstractly."""
  lowered = fn.lower(*args) if hasattr(fn, "lower") else jax.jit(fn).lower(*args)
  return lowered.out_info, lowered.compile().output_shardings


def plan_layers(job, mesh, programs, layers: int, group: str = ""):
  """(plans, note): `programs` compiled on `mesh`, at all layers or extrapolated from `layers`, 2x."""
  full_l = job.model.n_layers
  if layers and layers < full_l:
    la, lb = layers, 2 * layers
    if lb > full_l:
      raise SystemExit(f"--layers {layers}: needs 2 x {layers} <= model.n_layers={full_l}")
    pa = plan_step(_with_layers(job, la), mesh, programs, group)
    pb = plan_step(_with_layers(job, lb), mesh, programs, group)
    return ([extrapolate(a, b, la, lb, full_l) for a, b in zip(pa, pb)],
            f"figures compiled at {la} and {lb} of {full_l} layers and extrapolated linearly in the "
            f"layer count; compile s is the {lb}-layer compile")
  return plan_step(job, mesh, programs, group), f"all {full_l} layers compiled"


def _with_layers(job, n: int):
  m = dataclasses.replace(job.model, n_layers=n, mlp_only_layers=tuple(i for i in job.model.mlp_only_layers if i < n))
  return dataclasses.replace(job, model=m)
