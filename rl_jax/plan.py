"""Dry-run planner: compiles one RL step's real jitted programs on a simulated CPU mesh and reports cost.

  python -m rl_jax.plan --config=configs/X.py[:arg] [--device h100|h200|tpu_v5p] [--json OUT]
      [--devices N] [--layers N] [--programs sync,generate,old_forward,update]
      [--dispatch gspmd,shard_map] [--set model.scan_layers=False ...]

Everything is abstract (shapes + shardings, no parameter memory): the trainer's params and
optimizer state, the sampler's (quantized) weights, the rollout and the train batch. The
programs are the ones the trainer jits: the sampler-weight sync, the sampler's generate, the
theta_old forward (where the trainer runs it apart from the update: `default_programs`) and the
update, lowered with the config's mesh and batch shapes and compiled
by XLA:CPU on `mesh size` simulated devices. Per program it prints per-device bytes (arguments
by kind, outputs, temporaries, the other programs' state that stays resident meanwhile), FLOPs
and bytes accessed, and a roofline time on the named accelerator; it exits 1 naming the
largest contributors when a program does not fit that accelerator's memory.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import sys
import time
from typing import Any

from rl_jax import cli
from rl_jax import impl_log  # stdlib only: light enough for the planner's start-up

_ENV_DEVICES = "RL_JAX_PLAN_DEVICES"
# XLA:CPU's default scheduler optimizes for thread concurrency: it runs independent work early,
# e.g. every layer's remat recomputation before the first backward layer, so all layers'
# activations are live at once (an unrolled 0.6B update: 539 GiB of temporaries, not one
# layer's). GPU/TPU schedulers are memory-aware; the memory-optimized CPU scheduler is the
# closer stand-in for what they allocate (docs in README's scale-planning section).
_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"

HEADER = ("Estimate from XLA:CPU ({n} simulated devices, {sched} scheduler): memory_analysis / cost_analysis "
          "are what XLA:CPU would allocate and compute per device; GPU/TPU fusion and layouts differ. XLA counts a "
          "loop body once, so generate's decode loop and the chunked-logits scan are also costed "
          "analytically ('model' columns); the roofline takes the larger of the two.")


# ----------------------------------------------------------------------------------------
# Config and mesh size (no jax backend needed).


def load_config(spec: str):
  """`path.py[:arg]` -> the ConfigDict its `get_config(arg)` returns."""
  path, _, arg = spec.partition(":")
  if not os.path.isfile(path):
    raise SystemExit(f"--config: no file {path!r}")
  mod_spec = importlib.util.spec_from_file_location("_plan_config", path)
  if mod_spec is None:  # no loader for the suffix
    raise SystemExit(f"--config: {path!r} is not a Python config file (configs/X.py[:arg])")
  mod = importlib.util.module_from_spec(mod_spec)
  mod_spec.loader.exec_module(mod)
  if not hasattr(mod, "get_config"):
    raise SystemExit(f"--config: {path!r} defines no get_config(arg)")
  try:
    return mod.get_config(arg or None)
  except (ValueError, KeyError) as e:  # the file's own check of its `:arg` (configs/sweeps.py: KeyError)
    raise SystemExit(f"--config={spec}: {e.args[0] if e.args else type(e).__name__}") from e


def mesh_size(mesh_section: Any, devices: int) -> int:
  """Devices the config's mesh needs; an axis of -1 takes `devices` (or `mesh.num_devices`)."""
  sizes = [int(mesh_section.get(a, 1)) for a in ("data", "fsdp", "expert", "tensor")]
  if -1 not in sizes:
    return math.prod(sizes)
  n = int(mesh_section.get("num_devices", 0)) or devices
  return n


# ----------------------------------------------------------------------------------------
# Abstract state.


def _sds(shape_dtype, sharding):
  import jax  # pylint: disable=g-import-not-at-top
  return jax.ShapeDtypeStruct(shape_dtype.shape, shape_dtype.dtype, sharding=sharding)


def device_bytes(tree: Any) -> int:
  """Per-device bytes of a tree of sharded ShapeDtypeStructs or arrays (the largest shard)."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  total = 0
  for x in jax.tree.leaves(tree):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      itemsize = 8  # a threefry key: two uint32
    else:
      itemsize = np.dtype(x.dtype).itemsize
    shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
    total += int(np.prod(shape, dtype=np.int64)) * itemsize
  return total


def abstract_params(model_cfg, mesh):
  """(graphdef, params as sharded ShapeDtypeStructs): what `train_state.init_params` would place."""
  import jax  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from rl_jax import train_state  # pylint: disable=g-import-not-at-top
  from rl_jax import sharding as sh  # pylint: disable=g-import-not-at-top
  graphdef, abstract = train_state.abstract_state(model_cfg)
  return graphdef, jax.tree.map(_sds, nnx.to_pure_dict(abstract), sh.param_shardings(abstract, mesh))


def abstract_opt_state(optimizer, params, mesh):
  """Optimizer state with the shardings `train_state.init_opt_state` gives it (no memory)."""
  import jax  # pylint: disable=g-import-not-at-top
  from rl_jax import train_state  # pylint: disable=g-import-not-at-top
  return jax.tree.map(_sds, jax.eval_shape(optimizer.init, params),
                      train_state.opt_state_shardings(optimizer, params, mesh))


def opt_state_like_params(opt_state, params):
  """The optimizer state with every leaf that mirrors a parameter (same path suffix, same shape)
  sharded like that parameter: the layout `train_state.init_opt_state` produces."""
  import jax  # pylint: disable=g-import-not-at-top
  from rl_jax import train_state  # pylint: disable=g-import-not-at-top
  return jax.tree.map(_sds, opt_state, train_state.mirror_shardings(opt_state, params, None))


def kv_cache_sizing(model_cfg, sampler_cfg, rows: int, kv_spec, mesh) -> tuple[int, str]:
  """(per-device bytes, the product that gives them) of a KV cache for `rows` rows in flight (the
  continuous engine's slots, or a wave of the static engine's rows): rows per device (the batch
  axes split them) x S = P + T cache slots x layers x 2 (K and V) x kv heads per device ('tensor'
  splits them when it divides them) x head dim x bytes per element, plus the per-slot scales of a
  quantized format. Read off one row of `init_cache`'s layout, so packing and scale dtypes are
  the cache's own."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from rl_jax import sharding as sh  # pylint: disable=g-import-not-at-top
  from rl_jax.models.kv_cache import init_cache  # pylint: disable=g-import-not-at-top
  from rl_jax.models.layers import dtype_of  # pylint: disable=g-import-not-at-top
  s = sampler_cfg.max_len
  cache = jax.eval_shape(lambda: init_cache(model_cfg, 1, s, dtype_of(sampler_cfg.dtype), kv_spec,
                                            backend=getattr(sampler_cfg.quant, "backend", "auto")))
  nbytes = lambda x: int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
  values = sum(nbytes(kv.k) + nbytes(kv.v) for kv in cache)
  scales = sum(nbytes(kv.k_scale) + nbytes(kv.v_scale) for kv in cache if kv.k_scale is not None)
  div, tp = sh.batch_divisor(mesh), mesh.shape["tensor"]
  heads = model_cfg.n_kv_heads // tp if model_cfg.n_kv_heads % tp == 0 else model_cfg.n_kv_heads
  per_dev = -(-rows // div)
  layers, d = model_cfg.n_layers, model_cfg.head_dim
  elem = values / (s * layers * 2 * model_cfg.n_kv_heads * d)
  total = per_dev * (values + scales) * heads // model_cfg.n_kv_heads
  fmt = getattr(kv_spec, "format", None) or sampler_cfg.dtype
  text = (f"{per_dev} rows per device ({rows} over {div}) x S {s} (P {sampler_cfg.max_prompt_len} + T "
          f"{sampler_cfg.max_new_tokens}) x {layers} layers x 2 (K, V) x {heads} kv heads x {d} head dim x "
          f"{elem:g} B ({fmt})" + (f" + scales {scales / values:.3g} x that" if scales else "")
          + f" = {total / 2**30:.2f} GiB")
  return total, text


# ----------------------------------------------------------------------------------------
# Analytic FLOPs (XLA's cost analysis counts a loop body once).


def matmul_params(model_cfg) -> float:
  """Parameters one token multiplies through (MoE: the k routed experts of E), incl. the unembedding:
  the model family's count (`Family.matmul_params`)."""
  from rl_jax.models import families  # pylint: disable=g-import-not-at-top
  return families.of(model_cfg).matmul_params(model_cfg)


def attn_flops(model_cfg, q_tokens: float, kv_len: float) -> float:
  """QK^T and AV flops of `q_tokens` queries each over `kv_len` keys, all layers."""
  return 4.0 * q_tokens * kv_len * model_cfg.n_heads * model_cfg.head_dim * model_cfg.n_layers


# ----------------------------------------------------------------------------------------
# One program.


@dataclasses.dataclass
class ProgramPlan:
  """Per-device figures of one compiled program (bytes unless named otherwise)."""
  name: str
  args: dict[str, int]          # arguments by kind
  resident: dict[str, int]      # other state live on the device while this program runs
  argument: int = 0             # XLA memory_analysis
  output: int = 0
  alias: int = 0
  temp: int = 0
  code: int = 0
  kv_cache: int = 0             # part of `temp` (generate builds its cache inside)
  kv_cache_sizing: str = ""     # the product `kv_cache` is (kv_cache_sizing)
  engine: str = ""              # generate: the sampler engine and its slots / chunks
  flops_xla: float = 0.0
  bytes_xla: float = 0.0
  flops_model: float = 0.0
  bytes_model: float = 0.0
  comm_xla: float = 0.0         # bytes out of the compiled HLO's collectives (loop bodies once)
  comm_model: float = 0.0       # MoE dispatch bytes received, all layers and passes (analytic)
  time_s: float = 0.0           # roofline on the named accelerator
  compile_s: float = 0.0
  fingerprint: str = ""         # sha256 of the compiled HLO: the program the trainer runs has the same

  def contributors(self) -> dict[str, int]:
    """Per-device bytes live at this program's peak, by name (the fit check's terms)."""
    out = {f"arg {k}": v for k, v in self.args.items()}
    other = self.argument - sum(self.args.values())
    if other > 0:
      out["arg other"] = other
    out["outputs (not aliased)"] = max(self.output - self.alias, 0)
    if self.kv_cache:
      out["temporaries: KV cache"] = self.kv_cache
      out["temporaries: other"] = max(self.temp - self.kv_cache, 0)
    else:
      out["temporaries"] = self.temp
    out.update({f"resident {k}": v for k, v in self.resident.items()})
    return out

  @property
  def peak(self) -> int:
    return sum(self.contributors().values())


def _cost(compiled) -> tuple[float, float]:
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):  # older jax: one dict per partition
    cost = cost[0] if cost else {}
  cost = cost or {}
  return float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))


_COLLECTIVE_RE = None


def collective_bytes(hlo_text: str) -> int:
  """Sum of the output bytes of every collective op in compiled HLO text (each op once, so a
  collective inside a loop body, e.g. a scanned layer, counts once)."""
  import re  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  global _COLLECTIVE_RE
  if _COLLECTIVE_RE is None:
    ops = "all-gather|all-reduce|reduce-scatter|all-to-all|ragged-all-to-all|collective-permute"
    _COLLECTIVE_RE = re.compile(r"= (\(?[^=]*?\)?) (?:" + ops + r")(?:-start)?\(")
  itemsize = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "s16": 2,
              "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
  total = 0
  for m in _COLLECTIVE_RE.finditer(hlo_text):
    for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", m.group(1)):
      if dtype in itemsize:
        total += int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64)) * itemsize[dtype]
  return total


def fingerprint(compiled) -> str:
  """sha256 (16 hex digits) of a compiled program's HLO without its source metadata: equal for two
  lowerings of one program from different call sites (XLA's shardings are device assignments, so
  equivalent spellings of a sharding agree)."""
  import hashlib  # pylint: disable=g-import-not-at-top
  import re  # pylint: disable=g-import-not-at-top
  text = compiled.as_text()
  # The stack-frame tables (FileNames, FunctionNames, FileLocations, StackFrames: one block each, up to
  # a blank line) and every instruction's metadata={...} name the Python that traced it.
  text = re.sub(r"^(FileNames|FunctionNames|FileLocations|StackFrames)\n(?:.+\n)*", "", text, flags=re.M)
  text = re.sub(r",? metadata=\{[^{}]*\}", "", text)
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def compile_program(plan: ProgramPlan, lowered) -> Any:
  t0 = time.perf_counter()
  compiled = lowered.compile()
  plan.compile_s = time.perf_counter() - t0
  plan.fingerprint = fingerprint(compiled)
  mem = compiled.memory_analysis()
  plan.argument = int(mem.argument_size_in_bytes)
  plan.output = int(mem.output_size_in_bytes)
  plan.alias = int(mem.alias_size_in_bytes)
  plan.temp = int(mem.temp_size_in_bytes)
  plan.code = int(mem.generated_code_size_in_bytes)
  plan.flops_xla, plan.bytes_xla = _cost(compiled)
  try:
    plan.comm_xla = float(collective_bytes(compiled.as_text()))
  except Exception:  # pylint: disable=broad-except
    plan.comm_xla = 0.0  # the figure is informative only
  return compiled


# ----------------------------------------------------------------------------------------
# The step.


PROGRAMS = ("sync", "generate", "old_forward", "update", "first_order", "eval_greedy", "eval_sampled")


def default_programs(job) -> tuple[str, ...]:
  """The programs of PROGRAMS that `job`'s trainer runs: no separate p_old forward where the update
  computes p_old itself (`RLJob.old_in_update`: p_old 'latest', one mini-batch), no evaluation at
  `rl.eval_size=0`. `--programs` names any subset, these included."""
  skip = {"old_forward"} if job.old_in_update() else set()
  if not job.rl.eval_size:
    skip |= {"eval_greedy", "eval_sampled"}
  return tuple(p for p in PROGRAMS if p not in skip)


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
  import jax  # pylint: disable=g-import-not-at-top
  with jax.set_mesh(mesh):
    return _plan_step(job, mesh, default_programs(job) if programs is None else programs, group)


def dispatch_comm(job, mesh, tokens_per_device: float) -> float:
  """MoE dispatch bytes one device receives for `tokens_per_device` tokens through every MoE
  layer once (`expert_parallel.dispatch_comm_bytes`, the config's dispatch); 0 if dense."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from rl_jax import sharding as sh  # pylint: disable=g-import-not-at-top
  from rl_jax.models import expert_parallel as ep_lib  # pylint: disable=g-import-not-at-top
  m = job.model
  if not m.n_moe_layers:
    return 0.0
  per_token = ep_lib.dispatch_comm_bytes(
      m.moe_dispatch, tokens=1, d_model=m.d_model, n_experts=m.n_experts, top_k=m.n_experts_per_tok,
      expert_axis=mesh.shape["expert"], batch_shards=sh.batch_divisor(mesh),
      act_bytes=jnp.dtype(m.dtype).itemsize)["total"]
  return per_token * tokens_per_device * m.n_moe_layers


def _plan_step(job, mesh, programs: tuple[str, ...] = PROGRAMS, group: str = "") -> list[ProgramPlan]:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from rl_jax import microbatch  # pylint: disable=g-import-not-at-top
  from rl_jax import plan_hw  # pylint: disable=g-import-not-at-top
  from rl_jax import sharding as sh  # pylint: disable=g-import-not-at-top
  from rl_jax.optim import make_optimizer  # pylint: disable=g-import-not-at-top
  from rl_jax.rl import programs as programs_lib  # pylint: disable=g-import-not-at-top

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
    print(f"[plan] warning: the optimizer state takes {plan_hw.gib(n_opt)} per device as "
          f"train_state.init_opt_state lays it out (moments not sharded like their params); sharded like "
          f"the params it would take {plan_hw.gib(n_opt_like)}. The figures below are today's layout.")
  trainer_extra = {}
  delta = None
  if scfg.noise != "none":
    delta = jax.tree.map(lambda x: _sds(jax.ShapeDtypeStruct(x.shape, jnp.float32), x.sharding), params)
    trainer_extra["sampler noise"] = device_bytes(delta)
  if rl.staleness > 1:
    trainer_extra["sampler_src copy"] = n_params
  if rl.mode == "async" and rl.p_old_version == "rollout":
    trainer_extra["params copy (p_old at the rollout's version)"] = n_params
  plans = []

  # Sampler weights: cast(quantize(params + Delta)), the trainer's sync program.
  sync = ProgramPlan("sync", args={"params": n_params, **({"noise": trainer_extra["sampler noise"]}
                                                          if delta is not None else {})},
                     resident={"optimizer state": n_opt})
  lowered = progs.lower_sync(params, delta)
  compiled = compile_program(sync, lowered)
  sampler_state = jax.tree.map(_sds, lowered.out_info, compiled.output_shardings)
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
      from rl_jax.sampler.continuous import slot_count  # pylint: disable=g-import-not-at-top
      cache_rows = slot_count(cfg, rows, div)
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
    compile_program(g, progs.lower_generate(state, prompts, pvalid, key, kind))
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
  for name, kind, rows, cfg in (("eval_greedy", "greedy", rl.eval_size, progs.eval_cfg),
                                ("eval_sampled", "sampled", rl.eval_size * rl.eval_samples, progs.eval_sampled_cfg)):
    if name in programs and rows:  # rl.eval_size = 0: no evaluation, nothing to plan
      if clean is None:
        clean = jax.tree.map(_sds, *_lowered_out(progs.clean_weights, params))
      plan_generate(name, kind, rows, clean, device_bytes(clean), cfg)

  # The train batch: `jax.eval_shape` of the trainer's own assembly (`StepPrograms.batch_shapes`)
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
    compile_program(old, progs.lower_old_forward(params, batch, sampler_ids, sampler_valid))
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
      lowered = progs.lower_update(params, opt_state, mb)
    else:   # the meter reads the params before the update: the optimizer state stays resident
      resident["optimizer state"] = n_opt
      lowered = progs.lower_first_order(params, mb)
    q = ProgramPlan(name, args=args, resident=resident)
    compile_program(q, lowered)
    q.flops_model = fwd_flops * passes[name][1 if mcfg.remat else 0]
    # A backward moves what the forward did; remat replays the forward's dispatch.
    n_bwd = 1 if name == "update" else 2
    q.comm_model = dispatch_comm(job, mesh, (rows / div) * s) * (1 + n_bwd * (2 if mcfg.remat else 1))
    plans.append(q)
  return [q for q in plans if q.name in programs]


def prompt_args(rows: int, prompt_len: int, mesh):
  """Abstract (prompts_BP, valid_BP, key) of a `generate` over `rows` prompts, rows over the batch axes."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from rl_jax import sharding as sh  # pylint: disable=g-import-not-at-top
  prompts = _sds(jax.ShapeDtypeStruct((rows, prompt_len), jnp.int32), sh.batch_sharding(mesh, 2))
  pvalid = _sds(jax.ShapeDtypeStruct((rows, prompt_len), jnp.bool_), sh.batch_sharding(mesh, 2))
  return prompts, pvalid, _sds(jax.eval_shape(lambda: jax.random.key(0)), sh.replicated(mesh))


def step_args(progs, params, sampler_state, mesh) -> dict:
  """The abstract batch arguments of the trainer's programs, derived (not built): the rollout is
  `jax.eval_shape` of the sampler's generate over the step's prompts, the batches are
  `StepPrograms.batch_shapes` of it (the trainer's own `train_batch`, `prepare`, `minibatches`).
  'old_forward': (batch, sampler expert ids, their valid mask); 'prepared': the step's batch;
  'update' / 'first_order': (mini-batch,). Every array is laid out like the rollout's rows."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from rl_jax import sharding as sh  # pylint: disable=g-import-not-at-top
  rl, scfg = progs.job.rl, progs.job.sampler
  rows = rl.prompts_per_step * rl.group_size
  ro = progs.rollout_shapes(sampler_state, *prompt_args(rows, scfg.max_prompt_len, mesh))
  shapes = progs.batch_shapes(params, ro, jax.ShapeDtypeStruct((rows,), jnp.float32))
  rows_sharded = lambda tree: jax.tree.map(lambda x: _sds(x, sh.batch_sharding(mesh, x.ndim)), tree)
  old = rows_sharded((shapes["old_forward"], ro.expert_ids_BSLK, ro.expert_valid_BS))
  mb = rows_sharded(shapes["minibatch"])
  return {"old_forward": old, "prepared": rows_sharded(shapes["prepared"]), "update": (mb,), "first_order": (mb,)}


def _lowered_out(fn, *args):
  """(ShapeDtypeStructs, shardings) of jitted `fn`'s outputs, compiled abstractly."""
  import jax  # pylint: disable=g-import-not-at-top
  lowered = fn.lower(*args) if hasattr(fn, "lower") else jax.jit(fn).lower(*args)
  return lowered.out_info, lowered.compile().output_shardings


# ----------------------------------------------------------------------------------------
# Layer extrapolation, report, CLI.


def extrapolate(a: ProgramPlan, b: ProgramPlan, la: int, lb: int, l: int) -> ProgramPlan:
  """Figures at `l` layers from plans at `la` and `lb` layers, linear in the layer count."""
  f = (l - la) / (lb - la)
  lin = lambda x, y: x + (y - x) * f
  out = dataclasses.replace(a)
  for fld in dataclasses.fields(ProgramPlan):
    x, y = getattr(a, fld.name), getattr(b, fld.name)
    if fld.name in ("name", "compile_s", "fingerprint", "engine"):
      continue
    if fld.name == "kv_cache_sizing":  # the product at l layers (linear in them, as the bytes)
      if y:
        head = y.rsplit(" = ", 1)[0].replace(f" x {lb} layers x ", f" x {l} layers x ")
        setattr(out, fld.name, f"{head} = {int(round(lin(a.kv_cache, b.kv_cache))) / 2**30:.2f} GiB")
      continue
    if isinstance(x, dict):
      setattr(out, fld.name, {k: int(round(lin(x.get(k, 0), y.get(k, 0)))) for k in {**x, **y}})
    elif isinstance(x, int):
      setattr(out, fld.name, int(round(lin(x, y))))
    else:
      setattr(out, fld.name, lin(x, y))
  out.compile_s = b.compile_s
  return out


_LABEL, _COL = 40, 16  # table column widths


def _gib(n: float) -> str:
  return f"{n / 2**30:9.3f}"


def _row_order(name: str):
  kinds = ("params", "optimizer state", "noise", "sampler weights", "batch", "other")
  group = next(i for i, g in enumerate(("arg", "outputs", "temporaries", "resident")) if name.startswith(g))
  kind = next((i for i, k in enumerate(kinds) if k in name), len(kinds))
  return group, kind, name


def render(plans: list[ProgramPlan], acc, title: str) -> str:
  lines = [title, f"{'per device':<{_LABEL}}" + "".join(f"{p.name:>{_COL}}" for p in plans)]
  names = sorted({k for p in plans for k in p.contributors()}, key=_row_order)
  for k in names:
    lines.append(f"{k + ' GiB':<{_LABEL}}" + "".join(f"{_gib(p.contributors().get(k, 0)):>{_COL}}" for p in plans))
  rows = [("peak GiB", lambda p: _gib(p.peak)),
          (f"  of {acc.hbm_bytes / 1e9:.0f} GB", lambda p: f"{100 * p.peak / acc.hbm_bytes:8.1f}%"),
          ("XLA argument GiB", lambda p: _gib(p.argument)),
          ("XLA output GiB (aliased)", lambda p: f"{_gib(p.output).strip()} ({_gib(p.alias).strip()})"),
          ("XLA temporaries GiB", lambda p: _gib(p.temp)),
          ("XLA TFLOP", lambda p: f"{p.flops_xla / 1e12:9.3f}"),
          ("model TFLOP", lambda p: f"{p.flops_model / 1e12:9.3f}"),
          ("XLA GB accessed", lambda p: f"{p.bytes_xla / 1e9:9.2f}"),
          ("model GB accessed", lambda p: f"{p.bytes_model / 1e9:9.2f}"),
          ("XLA collectives GB (HLO, once)", lambda p: f"{p.comm_xla / 1e9:9.2f}"),
          ("model MoE dispatch GB received", lambda p: f"{p.comm_model / 1e9:9.2f}"),
          (f"roofline s ({acc.name})", lambda p: f"{p.time_s:9.3f}"),
          ("compile s (XLA:CPU)", lambda p: f"{p.compile_s:9.1f}")]
  for label, fn in rows:
    lines.append(f"{label:<{_LABEL}}" + "".join(f"{fn(p):>{_COL}}" for p in plans))
  return "\n".join(lines)


def expert_matmul_note(model_cfg, device: str) -> str:
  """Which expert matmul the figures assume: the config's choice resolved for the target `device`
  (models/moe.resolve_expert_matmul), and what XLA:CPU compiled in its place when they differ."""
  from rl_jax.models import moe  # pylint: disable=g-import-not-at-top
  platform = "tpu" if device.startswith("tpu") else "gpu"
  if model_cfg.batch_invariant:
    target = moe.resolve_expert_matmul("slab")
  else:
    target = moe.resolve_expert_matmul(model_cfg.expert_matmul, platform, model_cfg.dtype)
  compiled = moe.resolve_expert_matmul(model_cfg.expert_matmul, "cpu", model_cfg.dtype)
  note = f"expert matmul {target} on {device} (model.expert_matmul={model_cfg.expert_matmul})"
  if compiled != target:
    # The Pallas kernel has no XLA:CPU lowering worth costing (interpret mode), and XLA:CPU expands
    # ragged_dot densely: the slab stands in (grouped holds fewer rows than the slab's E x C >= 1.25 M).
    note += f", compiled here as {compiled}"
  return note


def _target_attention(call: dict, choice: str, platform: str, invariant: bool) -> str:
  """The attention implementation `platform` runs for one recorded call (impl_log "attention_call")."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from rl_jax.ops import attention as attn  # pylint: disable=g-import-not-at-top
  if invariant:
    return "blocked (batch-invariant)"
  choice = "blocked" if choice == "flash" else choice
  dtype = jnp.dtype(call["dtype"])
  offsets = dict(static_zero_offset=call["static_zero_offset"], static_offset=call["static_offset"],
                 causal=call["causal"])
  if choice == "auto":
    return attn.auto_impl(platform, dtype, call["b"], call["s"], call["c"], call["heads"], call["head_dim"],
                          **offsets, capability=(9, 0))
  if choice == "cudnn":
    reason = attn.cudnn_reason(dtype, call["head_dim"], call["static_zero_offset"], call["causal"], (9, 0))
    ok = platform == "gpu" and reason is None
    return "cudnn" if ok else "blocked"
  if choice == "splash":
    return "splash" if platform == "tpu" and (call["static_offset"] or not call["causal"]) else "blocked"
  return choice


def substitutions(log: dict, job, device: str) -> list[str]:
  """What XLA:CPU compiled in place of what `device` runs, from the choices the programs' traces
  recorded (rl_jax.impl_log): attention, quantized linears, the experts (plain and quantized)."""
  import collections  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from rl_jax.models import moe  # pylint: disable=g-import-not-at-top
  platform = "tpu" if device.startswith("tpu") else "gpu"
  fmt = lambda counts: ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))
  out = []
  calls = [impl_log.parse(c) for c in log.get("attention_call", {})]
  if calls:
    target = collections.Counter(_target_attention(c, job.model.attention, platform, job.model.batch_invariant)
                                 for c in calls)
    compiled = sorted(log.get("attention", {}))
    line = (f"attention {fmt(target)} on {device} (distinct call shapes), compiled here as {', '.join(compiled)}")
    if any(c["layout"] == "cache" and c["dtype"] != "float32" for c in calls):
      line += "; XLA:CPU's prefill also reads float32 copies of q and the cache's keys"
    out.append(line)
  quant_lin = sorted(log.get("quantized_linear", {}))
  if quant_lin:
    backend = getattr(job.sampler.quant, "backend", "auto") if job.sampler.quant is not None else "auto"
    target = "pallas qmatmul" if backend in ("auto", "pallas") else "xla dequantize + float32 dot"
    out.append(f"quantized linears {target} on {device}, compiled here as {', '.join(quant_lin)}")
  quant_exp = sorted(e for e in log.get("experts", {}) if e.startswith("quantized "))
  if quant_exp:
    dtype = job.sampler.dtype
    resolved = moe.resolve_expert_matmul(job.model.expert_matmul, platform, dtype)
    name = "grouped" if resolved == "grouped" else "ragged_dot"
    op = dtype if jnp.dtype(dtype).itemsize == 2 else "float32"
    out.append(f"quantized experts quantized {name} {op} on {device}, compiled here as {', '.join(quant_exp)}")
  plain_exp = sorted(e for e in log.get("experts", {}) if not e.startswith("quantized "))
  if plain_exp:
    out.append(f"experts {expert_matmul_note(job.model, device)}; traced here: {', '.join(plain_exp)}")
  return out


def run(config, device: str = "h100", devices: int = 1, layers: int = 0, mesh=None, out=print,
        programs: tuple[str, ...] | None = None, mem_fraction: float | None = None, notes: dict | None = None):
  """Plans `config`'s RL step; returns (plans, fits: dict program -> error message or None).
  `programs`: default the ones its trainer runs (`default_programs`).

  `notes` (a dict, optional) receives "substitutions": what XLA:CPU compiled in place of what
  `device` runs (`substitutions`), also printed under the table's header."""
  from rl_jax import plan_hw  # pylint: disable=g-import-not-at-top
  from rl_jax import sharding as sh  # pylint: disable=g-import-not-at-top
  from rl_jax.rl.job import RLJob  # pylint: disable=g-import-not-at-top
  if device not in plan_hw.DEVICES:
    raise SystemExit(f"--device {device!r}: not one of {sorted(plan_hw.DEVICES)}")
  acc = plan_hw.DEVICES[device]
  job = RLJob.from_config(config)
  programs = default_programs(job) if programs is None else programs
  split = job.rl.mode == "async" and job.mesh.sampler_devices > 0 and mesh is None
  if split:
    # Async on split devices: the sampler's programs on its group, the trainer's on the rest.
    mesh, sampler_mesh = sh.split_meshes(job.mesh, _first_devices(mesh_size(config.mesh, devices)))
    job.check_mesh(mesh, sampler_mesh)
    groups = [(sampler_mesh, tuple(p for p in programs if p in SAMPLER_PROGRAMS)),
              (mesh, tuple(p for p in programs if p not in SAMPLER_PROGRAMS))]
  else:
    mesh = mesh if mesh is not None else sh.make_mesh(job.mesh, _first_devices(mesh_size(config.mesh, devices)))
    groups = [(mesh, programs)]
  plans, note = [], ""
  mem_fraction = plan_hw.MEM_FRACTION if mem_fraction is None else mem_fraction
  log = {}
  for group_mesh, group in groups:
    if not group:
      continue
    with impl_log.recording() as group_log:
      group_plans, note = _plan_layers(job, group_mesh, group, layers,
                                       ("sampler" if group_mesh is sampler_mesh else "trainer") if split else "")
    for point, counts in group_log.items():
      log.setdefault(point, {}).update(counts)
    for p in group_plans:
      # Collectives: the HLO's (loop bodies once) or the analytic MoE dispatch, whichever is larger.
      p.time_s = plan_hw.roofline_s(max(p.flops_xla, p.flops_model), max(p.bytes_xla, p.bytes_model), acc,
                                    comm_bytes=max(p.comm_xla, p.comm_model), n_devices=group_mesh.size)
    plans += group_plans
  fits = {}
  for p in plans:
    try:
      plan_hw.check_fit(p.name, p.contributors(), acc, mem_fraction)
      fits[p.name] = None
    except plan_hw.DoesNotFit as e:
      fits[p.name] = str(e)
  mesh_desc = ", ".join(f"{k}={v}" for k, v in mesh.shape.items())
  if split:
    mesh_desc = (f"trainer {mesh_desc}; sampler (sync, generate) "
                 + ", ".join(f"{k}={v}" for k, v in sampler_mesh.shape.items()))
  model_desc = f"model.scan_layers={job.model.scan_layers}"
  if job.model.is_moe:
    model_desc += f", model.moe_dispatch={job.model.moe_dispatch}, {expert_matmul_note(job.model, device)}"
  sched = ("memory-optimized" if "concurrency_optimized_scheduler=false" in os.environ.get("XLA_FLAGS", "")
           else "default (concurrency-optimized)")
  subs = substitutions(log, job, device)
  if notes is not None:
    notes["substitutions"] = subs
  title = (HEADER.format(n=mesh.size, sched=sched) + f"\nmesh {mesh_desc}; {model_desc}; {note}; "
           f"step = {job.rl.prompts_per_step} prompts x {job.rl.group_size}, {job.rl.n_minibatches} "
           f"mini-batch update(s), S = {job.sampler.max_prompt_len} + {job.sampler.max_new_tokens}"
           + "".join(f"\nsubstitution: {line}" for line in subs))
  out(render(plans, acc, title))
  for p in plans:
    if p.kv_cache_sizing:
      out(f"{p.name}: engine {p.engine}; KV cache {p.kv_cache_sizing}")
  rl = job.rl
  # Per global step: N updates; the meter every `meter_every` steps and the evaluations every
  # `eval_every`, amortized.
  every = {"update": (rl.n_minibatches, f"{rl.n_minibatches} x update"),
           "first_order": (1 / rl.meter_every if rl.meter_every else 0.0, f"first_order / {rl.meter_every}"),
           "eval_greedy": (1 / rl.eval_every, f"eval_greedy / {rl.eval_every}"),
           "eval_sampled": (1 / rl.eval_every, f"eval_sampled / {rl.eval_every}")}
  total = sum(p.time_s * every.get(p.name, (1, ""))[0] for p in plans)
  terms = " + ".join(every.get(p.name, (1, p.name))[1] for p in plans)
  bw = plan_hw.comm_bw(acc, mesh.size)
  out(f"usable memory: {mem_fraction:g} x {acc.hbm_bytes / 1e9:.0f} GB; collectives at {bw / 1e9:.0f} GB/s per "
      f"chip ({'within a host' if mesh.size <= acc.per_host else 'across hosts, every collective taken to cross'}), "
      "not overlapped")
  out(f"roofline per global step ({terms}): "
      f"{total:.2f} s on {acc.name}")
  if split:
    amortized = {p.name: p.time_s * every.get(p.name, (1, ""))[0] for p in plans}
    gen = sum(t for k, t in amortized.items() if k in SAMPLER_PROGRAMS)
    rest = sum(t for k, t in amortized.items() if k not in SAMPLER_PROGRAMS)
    out(f"async (rl.max_staleness >= 1): the groups run side by side, max(sampler {gen:.2f} s on "
        f"{sampler_mesh.size}, trainer {rest:.2f} s on {mesh.size}) = {max(gen, rest):.2f} s per step on "
        f"{acc.name} (plus the weights' copy between the groups, not modelled)")
  return plans, fits


# The programs of the sampler's device group under async RL (`mesh.sampler_devices`).
SAMPLER_PROGRAMS = ("sync", "generate")


def _plan_layers(job, mesh, programs, layers: int, group: str = ""):
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


def set_key(config, item: str) -> None:
  """Applies one `--set a.b=value` override to a config section (value a Python literal, else a string)."""
  import ast  # pylint: disable=g-import-not-at-top
  key, eq, raw = item.partition("=")
  if not eq or not key:
    raise SystemExit(f"--set {item!r}: expected KEY=VALUE")
  *parents, leaf = key.split(".")
  node = config
  for i, name in enumerate(parents):
    if name not in node:
      raise SystemExit(f"--set {item!r}: the config has no section {name!r}")
    node = node[name]
    if not hasattr(node, "keys"):  # `in` on a str value would test substrings
      raise SystemExit(f"--set {item!r}: {'.'.join(parents[:i + 1])!r} is a value, not a section")
  if hasattr(node.get(leaf), "keys"):
    raise SystemExit(f"--set {item!r}: {key!r} is a section; set one of its keys")
  if leaf not in node and cli.schema_has(key) is False:
    raise SystemExit(f"--set {item!r}: {cli.unknown_key(key)}")
  # A key the section lacks but the schema has is added (e.g. a ModelConfig field left at its
  # default); outside the schema's sections the job's own validation (RLJob.from_config) judges.
  try:
    value = ast.literal_eval(raw)
  except (ValueError, SyntaxError):
    value = raw
  node[leaf] = value


def _commit() -> str:
  """The repository's HEAD commit (with "+dirty" for uncommitted changes), or "" outside a checkout."""
  import subprocess  # pylint: disable=g-import-not-at-top
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  try:
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=10)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo, capture_output=True,
                           text=True, timeout=10)
  except (OSError, subprocess.SubprocessError):
    return ""
  return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "") if head.returncode == 0 else ""


def _first_devices(n: int):
  import jax  # pylint: disable=g-import-not-at-top
  have = jax.devices()
  if len(have) < n:
    raise SystemExit(f"the mesh needs {n} devices, jax has {len(have)} (set XLA_FLAGS="
                     f"--xla_force_host_platform_device_count={n} before jax starts)")
  return have[:n]


def _with_layers(job, n: int):
  m = dataclasses.replace(job.model, n_layers=n, mlp_only_layers=tuple(i for i in job.model.mlp_only_layers if i < n))
  return dataclasses.replace(job, model=m)


@cli.expected_errors("python -m rl_jax.plan")
def main(argv: list[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  ap = argparse.ArgumentParser(prog="python -m rl_jax.plan", description=__doc__.splitlines()[0])
  ap.add_argument("--config", required=True, help="configs/X.py[:arg]")
  ap.add_argument("--device", default="h100", help="accelerator: h100 | h200 | tpu_v5p")
  ap.add_argument("--devices", type=int, default=1, help="mesh size when a mesh axis is -1")
  ap.add_argument("--layers", type=int, default=0, help="compile N and 2N layers, extrapolate to all")
  ap.add_argument("--programs", default="", help="comma-separated subset of " + ",".join(PROGRAMS) +
                  " (default: those the config's trainer runs)")
  ap.add_argument("--dispatch", default="", help="MoE: plan each of these model.moe_dispatch values "
                  "(comma-separated, e.g. gspmd,shard_map) instead of the config's")
  ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                  help="override a config key, e.g. --set model.scan_layers=False (repeatable)")
  ap.add_argument("--json", default="", help="write the figures here")
  ap.add_argument("--mem_fraction", type=float, default=None,
                  help="usable share of the accelerator's memory (default 0.9, the launch scripts' "
                       "XLA_PYTHON_CLIENT_MEM_FRACTION)")
  args = ap.parse_args(argv)
  config = load_config(args.config)
  for item in args.set:
    set_key(config, item)
  programs = tuple(x for x in args.programs.split(",") if x) or None
  unknown = sorted(set(programs or ()) - set(PROGRAMS))
  if unknown:  # before the re-exec below: no second process for a typo
    raise SystemExit(f"--programs: unknown {unknown}; valid: {','.join(PROGRAMS)}")
  n = mesh_size(config.mesh, args.devices)
  if os.environ.get(_ENV_DEVICES) != str(n):
    # The simulated device count is read when jax's CPU backend starts: start a fresh process.
    env = dict(os.environ, JAX_PLATFORMS="cpu", **{_ENV_DEVICES: str(n)})
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    if "xla_cpu_enable_concurrency_optimized_scheduler" not in env.get("XLA_FLAGS", ""):
      flags.append(_SCHEDULER_FLAG)
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={n}"])
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-m", "rl_jax.plan", *argv], env)
  dispatches = [d for d in args.dispatch.split(",") if d] or [None]
  results, fits = [], {}
  for d in dispatches:
    if d is not None:
      config.model.moe_dispatch = d
    notes = {}
    plans, d_fits = run(config, args.device, args.devices, args.layers, programs=programs,
                        mem_fraction=args.mem_fraction, notes=notes)
    results.append(dict(dispatch=config.model.get("moe_dispatch", "gspmd"),
                        programs=[dict(dataclasses.asdict(p), peak=p.peak) for p in plans], fits=d_fits,
                        substitutions=notes["substitutions"]))
    fits.update({(f"{p} [{d}]" if d else p): m for p, m in d_fits.items()})
    print()
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"config": args.config, "device": args.device, "layers": args.layers, "commit": _commit(),
                 **(results[0] if len(results) == 1 else {"by_dispatch": results})}, f, indent=1)
  bad = [m for m in fits.values() if m]
  for m in bad:
    print(f"DOES NOT FIT: {m}", file=sys.stderr)
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
