"""Where a jitted program's time goes on XLA:CPU: jax.profiler self time per HLO instruction, summed by kind."""
# Usage:
#   PYTHONPATH=. python benchmarks/profile_ops.py                      # the study model: update + p_old
#   PYTHONPATH=. python benchmarks/profile_ops.py --models dense,moe   # issue 15's peer-benchmark models
#   PYTHONPATH=. python benchmarks/profile_ops.py --models study --attention xla,native --calls 5
#
# Models: "study" is configs/countdown_tiny.py's model (the README main job's and every study's:
# vocab 80, 2 layers of 4 heads x 16, MoE 8 experts top-2) at its batch, 32 prompts x 8 samples of
# 24 prompt + 12 response tokens; "dense" / "moe" are bench_train_peers.py's issue 15 models at its
# batch (32 x (32 + 128)). Each program is the trainer's own jitted `step.update` / `step.old_forward`
# (bench_train_peers.Ours), warmed up, then traced over --calls calls with jax.profiler (a perfetto
# trace). A thunk's self time (its duration less its children's on the same thread: a while loop's
# body thunks are not counted twice) is summed per HLO instruction, and each instruction's kind is
# read from the compiled HLO text (`compiled.as_text()`): dots (YNNPACK / oneDNN fusions and plain
# dots), the native attention and top-k custom calls, reductions (softmax, log-softmax, norms),
# elementwise fusions, layout copies / transposes, MoE dispatch (sort, gather, scatter,
# dynamic-update-slice), control flow and the rest. Wall time per call is the median outside the
# trace. Prints a table per (model, attention, program): ms per call and share, and the top
# instructions with their shapes.
from __future__ import annotations

if __name__ == "__main__":  # before jax loads: XLA:CPU runs re-exec with an allocator preloaded (as the peers' benchmark)
  from rl_jax import host_memory  # pylint: disable=g-import-not-at-top
  host_memory.reexec_tuned()

import argparse
import collections
import dataclasses
import glob
import gzip
import json
import os
import re
import statistics
import sys
import tempfile
import time

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# pylint: disable=wrong-import-position
import bench_train_peers as peers  # the update / p_old programs and batches of the peer benchmark

from rl_jax.models.config import ModelConfig

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([\w\-]+)\((.*)$")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_COMP = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")


def hlo_kinds(text: str) -> dict[str, tuple[str, str]]:
  """instruction name -> (kind, shape) for every instruction of the compiled HLO text; a fusion's
  kind is read from what its fused computation holds."""
  comps: dict[str, list[str]] = collections.defaultdict(list)  # computation -> opcodes it holds
  instrs: dict[str, tuple[str, str, str]] = {}  # name -> (opcode, shape, rest of line)
  current = None
  for line in text.splitlines():
    m = _COMP.match(line)
    if m and "=" not in line.split("{")[0]:
      current = m.group(1)
      continue
    m = _INSTR.match(line)
    if not m:
      continue
    name, shape, opcode, rest = m.groups()
    instrs[name] = (opcode, shape, rest)
    if current:
      comps[current].append(opcode if opcode != "custom-call" else "custom-call:" + (_TARGET.findall(rest) or ["?"])[0])

  def classify(opcode: str, rest: str) -> str:
    if opcode == "custom-call":
      target = (_TARGET.findall(rest) or ["?"])[0]
      if "attention" in target:
        return "attention (native)"
      if "top_k" in target.lower() or "topk" in target.lower():
        return "top-k"
      if "xnn" in target or "ynn" in target or "onednn" in target.lower():
        return "matmul"
      return f"custom-call {target}"
    if opcode in ("dot", "convolution"):
      return "matmul"
    if opcode == "fusion":
      called = _CALLS.findall(rest)
      ops = [o for c in called for o in comps.get(c, [])]
      if any(o in ("dot", "convolution") or "xnn" in o or "ynn" in o for o in ops) or "ynn" in rest or "xnn" in rest:
        return "matmul"
      if any(o in ("sort", "gather", "scatter", "dynamic-update-slice", "dynamic-slice") for o in ops):
        return "gather / scatter / slices"
      if any(o == "reduce" for o in ops):
        return "reductions (softmax, norms, sums)"
      if ops and all(o in ("copy", "transpose", "bitcast", "parameter", "reshape", "broadcast", "slice",
                           "concatenate", "pad") for o in ops):
        return "layout copies"
      return "elementwise"
    if opcode in ("copy", "transpose", "concatenate", "pad", "slice", "reshape", "broadcast", "copy-start", "copy-done"):
      return "layout copies"
    if opcode in ("sort", "gather", "scatter", "dynamic-update-slice", "dynamic-slice", "select-and-scatter"):
      return "gather / scatter / slices"
    if opcode == "reduce":
      return "reductions (softmax, norms, sums)"
    if opcode in ("while", "conditional", "call", "tuple", "get-tuple-element", "parameter", "constant"):
      return "control"
    return "elementwise" if opcode in ("add", "multiply", "exponential", "log", "select", "compare", "divide",
                                       "subtract", "maximum", "minimum", "convert", "negate", "iota") else opcode

  return {name: (classify(opcode, rest), shape) for name, (opcode, shape, rest) in instrs.items()}


# Events that time a thread waiting on the intra-op pool, which the pool's own thunk events already count.
_WAITS = ("ThunkExecutor::Execute (wait for completion)", "SlinkyThreadPool::Await", "CommonPjRtBuffer::Await")


def self_times(trace_dir: str) -> dict[str, float]:
  """Thunk name -> summed self time (s) over the trace, from XLA's worker threads."""
  path = sorted(glob.glob(os.path.join(trace_dir, "**", "*perfetto_trace.json.gz"), recursive=True))[-1]
  with gzip.open(path) as f:
    trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  names = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
  by_tid = collections.defaultdict(list)
  for e in events:
    if e.get("ph") == "X" and not names.get(e.get("tid"), "").startswith("python"):
      by_tid[e["tid"]].append(e)
  out = collections.Counter()
  for evs in by_tid.values():
    evs.sort(key=lambda e: (e["ts"], -e["dur"]))
    stack: list[list] = []  # [end, name, child time]
    for e in evs:
      while stack and e["ts"] >= stack[-1][0]:
        end, name, child, dur = stack.pop()
        out[name] += (dur - child) * 1e-6
      if stack:
        stack[-1][2] += e["dur"]
      stack.append([e["ts"] + e["dur"], e["name"], 0.0, e["dur"]])
    while stack:
      end, name, child, dur = stack.pop()
      out[name] += (dur - child) * 1e-6
  return out


@dataclasses.dataclass
class Profile:
  wall_s: float          # median wall time per call, untraced
  by_kind: dict          # kind -> seconds per call
  top: list              # (instruction, kind, shape, seconds per call)


def profile(fn, args, calls: int, rounds: int = 3) -> Profile:
  compiled = fn.lower(*args).compile()
  kinds = hlo_kinds(compiled.as_text())
  for _ in range(2):
    jax.block_until_ready(fn(*args))
  walls = []
  for _ in range(rounds):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    walls.append(time.perf_counter() - t0)
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d, create_perfetto_trace=True):
      for _ in range(calls):
        jax.block_until_ready(fn(*args))
    times = self_times(d)
  by_kind = collections.Counter()
  top = []
  for name, t in times.items():
    if name.startswith(_WAITS):  # a thread waiting for the others' work: not work itself
      continue
    kind, shape = kinds.get(name, ("runtime / unmapped", ""))
    by_kind[kind] += t / calls
    top.append((name, kind, shape, t / calls))
  top.sort(key=lambda x: -x[3])
  return Profile(statistics.median(walls), dict(by_kind), top)


def programs(name: str, attention: str):
  if name == "study":
    cfg, data, p = peers.study_model()
  else:
    cfg, data, p = ModelConfig(**peers.MODELS[name]), peers.make_batch(32, 32, 128, peers.MODELS[name]["vocab_size"]), 32
  ours = peers.Ours(cfg, data, p, attention=attention)
  # p_old first: the update donates the params it is given.
  return {"p_old": (ours.old_forward, (ours.params, ours.batch), ours),
          "update": (ours.update, (ours.params, ours.opt_state, ours.batch), ours)}


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--models", default="study", help="comma-separated: study, dense, moe")
  ap.add_argument("--attention", default="auto", help="comma-separated model.attention values")
  ap.add_argument("--calls", type=int, default=5)
  ap.add_argument("--top", type=int, default=12)
  args = ap.parse_args()
  print(f"jax {jax.__version__}, backend {jax.default_backend()}, {os.cpu_count()} cores")
  for name in args.models.split(","):
    for attention in args.attention.split(","):
      progs = programs(name, attention)
      for prog, (fn, fargs, ours) in progs.items():
        if prog == "update":  # the update donates params and optimizer state: each call feeds the next
          res = profile(_Donating(fn, ours), (), args.calls)
        else:
          res = profile(fn, fargs, args.calls)
        total = sum(res.by_kind.values())
        print(f"\n== {name} / attention={attention} / {prog}: wall {res.wall_s * 1e3:.1f} ms per call "
              f"(untraced median); traced thread time {total * 1e3:.1f} ms (summed over the pool's threads)")
        for kind, t in sorted(res.by_kind.items(), key=lambda x: -x[1]):
          print(f"  {kind:38s} {t * 1e3:8.2f} ms  {t / total:6.1%}")
        print("  top instructions:")
        for inst, kind, shape, t in res.top[:args.top]:
          print(f"    {t * 1e3:7.2f} ms  {kind:28s} {inst:40s} {shape[:70]}")


class _Donating:
  """The update as a zero-argument program: each call feeds the previous call's donated outputs."""
  def __init__(self, fn, ours):
    self.fn, self.ours = fn, ours

  def lower(self):
    return self.fn.lower(self.ours.params, self.ours.opt_state, self.ours.batch)

  def __call__(self):
    o = self.ours
    o.params, o.opt_state, m = self.fn(o.params, o.opt_state, o.batch)
    return m


if __name__ == "__main__":
  main()
