"""The planner's report: each program's figures as a table, what XLA:CPU compiled in place of the
target's kernels, the fit check and the roofline per step (`run`, what `python -m rl_jax.plan` prints)."""
from __future__ import annotations

import collections
import os

import jax
import jax.numpy as jnp

from rl_jax import impl_log
from rl_jax import sharding as sh
from rl_jax.models import moe
from rl_jax.ops import attention as attn
from rl_jax.plan import hw
from rl_jax.plan.config import SAMPLER_PROGRAMS, default_programs, mesh_size
from rl_jax.plan.cost import ProgramPlan
from rl_jax.plan.steps import plan_layers
from rl_jax.rl.job import RLJob


HEADER = ("Estimate from XLA:CPU ({n} simulated devices, {sched} scheduler): memory_analysis / cost_analysis "
          "are what XLA:CPU would allocate and compute per device; GPU/TPU fusion and layouts differ. XLA counts a "
          "loop body once, so generate's decode loop and the chunked-logits scan are also costed "
          "analytically ('model' columns); the roofline takes the larger of the two.")


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
  if device not in hw.DEVICES:
    raise SystemExit(f"--device {device!r}: not one of {sorted(hw.DEVICES)}")
  acc = hw.DEVICES[device]
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
  mem_fraction = hw.MEM_FRACTION if mem_fraction is None else mem_fraction
  log = {}
  for group_mesh, group in groups:
    if not group:
      continue
    with impl_log.recording() as group_log:
      group_plans, note = plan_layers(job, group_mesh, group, layers,
                                       ("sampler" if group_mesh is sampler_mesh else "trainer") if split else "")
    for point, counts in group_log.items():
      log.setdefault(point, {}).update(counts)
    for p in group_plans:
      # Collectives: the HLO's (loop bodies once) or the analytic MoE dispatch, whichever is larger.
      p.time_s = hw.roofline_s(max(p.flops_xla, p.flops_model), max(p.bytes_xla, p.bytes_model), acc,
                                    comm_bytes=max(p.comm_xla, p.comm_model), n_devices=group_mesh.size)
    plans += group_plans
  fits = {}
  for p in plans:
    try:
      hw.check_fit(p.name, p.contributors(), acc, mem_fraction)
      fits[p.name] = None
    except hw.DoesNotFit as e:
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
  bw = hw.comm_bw(acc, mesh.size)
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


def _first_devices(n: int):
  have = jax.devices()
  if len(have) < n:
    raise SystemExit(f"the mesh needs {n} devices, jax has {len(have)} (set XLA_FLAGS="
                     f"--xla_force_host_platform_device_count={n} before jax starts)")
  return have[:n]
