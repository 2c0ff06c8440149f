"""One compiled program's figures (XLA's memory and cost analyses, the analytic FLOPs and dispatch
bytes XLA's loop-once counting misses) and their extrapolation in the layer count."""
from __future__ import annotations

import dataclasses
import hashlib
import re
import time
from typing import Any

import jax.numpy as jnp
import numpy as np

from rl_jax import sharding as sh
from rl_jax.models import expert_parallel as ep_lib
from rl_jax.models import families


def matmul_params(model_cfg) -> float:
  """Parameters one token multiplies through (MoE: the k routed experts of E), incl. the unembedding:
  the model family's count (`Family.matmul_params`)."""
  return families.of(model_cfg).matmul_params(model_cfg)


def attn_flops(model_cfg, q_tokens: float, kv_len: float) -> float:
  """QK^T and AV flops of `q_tokens` queries each over `kv_len` keys, all layers."""
  return 4.0 * q_tokens * kv_len * model_cfg.n_heads * model_cfg.head_dim * model_cfg.n_layers


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


_COLLECTIVES = "all-gather|all-reduce|reduce-scatter|all-to-all|ragged-all-to-all|collective-permute"
_COLLECTIVE_RE = re.compile(r"= (\(?[^=]*?\)?) (?:" + _COLLECTIVES + r")(?:-start)?\(")


def collective_bytes(hlo_text: str) -> int:
  """Sum of the output bytes of every collective op in compiled HLO text (each op once, so a
  collective inside a loop body, e.g. a scanned layer, counts once)."""
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


def dispatch_comm(job, mesh, tokens_per_device: float) -> float:
  """MoE dispatch bytes one device receives for `tokens_per_device` tokens through every MoE
  layer once (`expert_parallel.dispatch_comm_bytes`, the config's dispatch); 0 if dense."""
  m = job.model
  if not m.n_moe_layers:
    return 0.0
  per_token = ep_lib.dispatch_comm_bytes(
      m.moe_dispatch, tokens=1, d_model=m.d_model, n_experts=m.n_experts, top_k=m.n_experts_per_tok,
      expert_axis=mesh.shape["expert"], batch_shards=sh.batch_divisor(mesh),
      act_bytes=jnp.dtype(m.dtype).itemsize)["total"]
  return per_token * tokens_per_device * m.n_moe_layers


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
