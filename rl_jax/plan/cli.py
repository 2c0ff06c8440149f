"""The planner's command line: flags, the re-exec with the mesh's simulated device count, the JSON record."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys

from rl_jax import cli
from rl_jax import plan as plan_pkg
from rl_jax.plan.config import PROGRAMS, load_config, mesh_size, set_key


_ENV_DEVICES = "RL_JAX_PLAN_DEVICES"
# XLA:CPU's default scheduler optimizes for thread concurrency: it runs independent work early,
# e.g. every layer's remat recomputation before the first backward layer, so all layers'
# activations are live at once (an unrolled 0.6B update: 539 GiB of temporaries, not one
# layer's). GPU/TPU schedulers are memory-aware; the memory-optimized CPU scheduler is the
# closer stand-in for what they allocate (docs/planning.md).
_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def _commit() -> str:
  """The repository's HEAD commit (with "+dirty" for uncommitted changes), or "" outside a checkout."""
  repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  try:
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=10)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo, capture_output=True,
                           text=True, timeout=10)
  except (OSError, subprocess.SubprocessError):
    return ""
  return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "") if head.returncode == 0 else ""


@cli.expected_errors("python -m rl_jax.plan")
def main(argv: list[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  ap = argparse.ArgumentParser(prog="python -m rl_jax.plan", description=plan_pkg.__doc__.splitlines()[0])
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
  # The model stack loads here, in the process with the mesh's device count.
  from rl_jax.plan.report import run  # pylint: disable=g-import-not-at-top
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
