"""What `rl.inflight_resume` costs: checkpoint bytes of the rollouts in generation and their restore time, 'carry' vs 'reprefill'.

Usage:
  PYTHONPATH=. python benchmarks/bench_inflight_resume.py [--workdir /tmp/bench_inflight_resume]

For each form, the SIGTERM test's run (tests/test_inflight_updates.py: countdown_tiny:test, async
K = 2, in-flight updates in chunks of 3 iterations, the sampler on 4 of 8 simulated CPU devices) is
preempted while step 1 trains, so checkpoint 2 holds the rollouts of steps 2 and 3 in generation.
Reported: the bytes of its `inflight` item (its arrays, from the checkpoint's metadata, and on
disk), then the restore of those rollouts three times: by the resuming trainer (the first call:
the re-prefill compiles) and twice more on the same trainer (compiled), each waited for. Then the
same arrays' bytes, abstractly (nothing runs), for one rollout at `--scale`'s config (default the
30B pod config, whose planned KV cache is 12 GiB per device), per device over its 16 batch-axis
devices.

Measured 2026-12-05 on the 2-core CPU box (load ~3.7): 'carry' 337,512 B of arrays (182,279 B on
disk), restore 0.51 s then 0.07 s; 'reprefill' 34,472 B (63,186 B on disk), restore 3.54 s (the
re-prefill's compile) then 0.10-0.12 s; at the 30B pod config a 15.48 GiB carry (12.28 GiB KV cache)
against a 3.16 GiB progress (3.02 GiB of routes) per device (docs/performance.md).
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse  # pylint: disable=g-import-not-at-top,wrong-import-position
import dataclasses  # pylint: disable=g-import-not-at-top,wrong-import-position
import signal  # pylint: disable=g-import-not-at-top,wrong-import-position
import time  # pylint: disable=g-import-not-at-top,wrong-import-position
import types  # pylint: disable=g-import-not-at-top,wrong-import-position

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position
import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top,wrong-import-position

from rl_jax import preempt  # pylint: disable=g-import-not-at-top,wrong-import-position
from rl_jax.rl import resume  # pylint: disable=g-import-not-at-top,wrong-import-position
from rl_jax.rl import trainer as trainer_lib  # pylint: disable=g-import-not-at-top,wrong-import-position
from rl_jax.sampler import continuous  # pylint: disable=g-import-not-at-top,wrong-import-position
from rl_jax.sampler import generate as gen  # pylint: disable=g-import-not-at-top,wrong-import-position
from rl_jax.study import sweeps  # pylint: disable=g-import-not-at-top,wrong-import-position
from rl_jax.study.config import load_base  # pylint: disable=g-import-not-at-top,wrong-import-position

RUN = {"rl.mode": "async", "mesh.sampler_devices": 4, "mesh.tensor": 2, "sampler.engine": "continuous",
       "rl.max_staleness": 2, "rl.steps": 4, "rl.eval_every": 4, "rl.checkpoint_every": 10, "rl.inflight_chunk": 3,
       "rl.inflight_updates": True, "warm_start.source": "none"}
GIB = 2 ** 30


def _bytes(tree) -> int:
  return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _du(path: str) -> int:
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def measure(mode: str, workdir: str) -> dict:
  cfg = sweeps.apply_overrides(load_base("configs/countdown_tiny.py:test"), {**RUN, "rl.inflight_resume": mode})
  real = trainer_lib.RLTrainer.train_on

  def signal_during_step_1(self, item, t0, t1):
    if item.step == 1:
      os.kill(os.getpid(), signal.SIGTERM)
    return real(self, item, t0, t1)
  trainer_lib.RLTrainer.train_on = signal_during_step_1
  try:
    trainer_lib.run(cfg, workdir)
  except preempt.Preempted:
    pass
  finally:
    trainer_lib.RLTrainer.train_on = real
  item = os.path.join(workdir, "checkpoints", "2", "inflight")
  out = {"arrays": _bytes(ocp.StandardCheckpointer().metadata(item).item_metadata.tree), "disk": _du(item)}
  times, metas = [], []
  restore = resume.restore_inflight

  def timed(tr, meta):
    t = time.perf_counter()
    queue = restore(tr, meta)
    jax.block_until_ready([p.carry for p in queue])
    times.append(time.perf_counter() - t)
    metas.append(meta)
    return queue
  resume.restore_inflight = timed
  try:
    tr = trainer_lib.RLTrainer(cfg, workdir)
    for _ in range(2):
      timed(tr, metas[0])
    tr.close()
  finally:
    resume.restore_inflight = restore
  out["restore_s"] = times
  return out


def at_scale(spec: str, div: int) -> dict:
  """One rollout's carry, its KV cache and its progress in bytes per device at `spec`'s config over
  `div` batch-axis devices (abstract: `continuous.init` without its prefill reads only the model's
  config)."""
  job = trainer_lib.RLJob.from_config(load_base(spec))
  cfg = job.sampler
  mcfg = dataclasses.replace(job.model, dtype=cfg.dtype)
  b = job.rl.prompts_per_step * job.rl.group_size
  p = cfg.max_prompt_len
  init = lambda ids, valid, keys, mx: continuous.init(
      types.SimpleNamespace(cfg=mcfg), ids, valid, keys, mx, cfg=cfg, kv_spec=gen.resolve_kv_spec(None, cfg),
      constrain=lambda t: t, div=div, versions=True, prefill=False)
  carry = jax.eval_shape(init, jax.ShapeDtypeStruct((b, p), jnp.int32), jax.ShapeDtypeStruct((b, p), bool),
                         jax.ShapeDtypeStruct((b, 2), jnp.uint32), jax.ShapeDtypeStruct((b,), jnp.int32))
  prog = jax.eval_shape(lambda c: continuous.progress(c, cfg=cfg), carry)
  return {"batch devices": div, "carry": _bytes(carry) / div, "cache": _bytes(carry["cache"]) / div,
          "progress": _bytes(prog) / div,
          "routes": (_bytes(prog["experts_BSLK"]) / div) if prog["experts_BSLK"] is not None else 0}


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--workdir", default="/tmp/bench_inflight_resume")
  ap.add_argument("--scale", default="configs/qwen3_30b_a3b_minirl.py:n4_32k")
  ap.add_argument("--scale-batch-devices", type=int, default=16)  # the pinned plan's (docs/plans)
  args = ap.parse_args()
  for mode in ("carry", "reprefill"):
    r = measure(mode, os.path.join(args.workdir, f"{mode}_{int(time.time())}"))
    print(f"{mode:9s}: in-flight item {r['arrays']} B of arrays ({r['disk']} B on disk); restore "
          + ", ".join(f"{t:.3f} s" for t in r["restore_s"]) + " (first, then compiled)", flush=True)
  s = at_scale(args.scale, args.scale_batch_devices)
  print(f"{args.scale}, per device over {s['batch devices']} batch devices, one rollout in generation: carry "
        f"{s['carry'] / GIB:.2f} GiB (KV cache {s['cache'] / GIB:.2f}), progress {s['progress'] / GIB:.2f} GiB "
        f"(routes {s['routes'] / GIB:.2f})")


if __name__ == "__main__":
  main()
