"""Time split of one RL step of configs/countdown_tiny.py and the overhead of score centering and the meters."""
# Usage:
#   python benchmarks/bench_rl_step.py                 # the README config (32 x 8, INT8/INT4 sampler)
#   python benchmarks/bench_rl_step.py --small         # its `:test` variant (4 x 2, 2-layer model)
#   python benchmarks/bench_rl_step.py --vocab-heavy   # the same with an 8192-token vocabulary
#   python benchmarks/bench_rl_step.py --compare meters  # first-order meter every M steps vs off
#   python benchmarks/bench_rl_step.py --compare drift   # top-k carried to the loss (drift meter) vs not
#   XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/bench_rl_step.py --compare mode
#                                                         # async (K=1, sampler on half the devices) vs sync
#   python benchmarks/bench_rl_step.py --small --compare invariant  # the zero-mismatch mode's cost
#   python benchmarks/bench_rl_step.py --compare attribution  # per-source attribution every step vs off
#   python benchmarks/bench_rl_step.py --compare p_old   # p_old from the update's forward vs its own forward
#
# Two `RLTrainer`s are built from the config with warm_start.source='none' (random init:
# timing only), wandb disabled, in a temporary workdir. `--compare sc` (default): "sc" with
# loss.score_centering='topk' (k=16) and "pg" with 'none' (plain policy gradient), both with
# the first-order meter off. `--compare meters`: the config's loss with rl.meter_every=M
# ("on") vs 0 ("off"). `--compare drift`: plain PG, meter off, "drift" carrying the sampler's
# top-k to the loss (the default: the loss then computes drift/tv_*) vs "nodrift", whose batch
# drops it (the behaviour before the drift meter was on by default). `--compare mode`: "async"
# (rl.mode='async', max_staleness 1, the sampler on half the devices, the trainer on the other
# half) vs "sync" on half the devices (the same mesh for its trainer, so the ratio is the overlap); `--compare invariant`:
# "invariant" (model.batch_invariant=True: the certified zero-mismatch mode) vs "default", both with
# an unquantized fp32 sampler and the config's loss; `--compare attribution`: "attr" with
# rl.attribution_every=1 (rl.attribution_rows rows through one sampler per mismatch source of the
# config's sampler) vs "off", also reported per call and at --attribution-every; `--compare p_old`:
# "inupdate" (the default rl.p_old_in_update: no separate p_old forward at 'latest' with N = 1) vs
# "separate" (rl.p_old_in_update=False), both with the config's loss; 'sampler_wait' is how long async's host waited for the rollout
# generated ahead once the updates were done; `--compare mode` also prints each trainer's median
# `async/sampler_busy`, `async/trainer_busy` and `async/busy_overlap` next to its step time.
# A loss config is baked into
# each trainer's jitted update, hence two trainers; both keep the same sampler settings,
# prompts and keys (top-k still recorded), so the difference is the loss / meter (the rollouts
# themselves diverge after step 1, as the two policies do). Step 0 of each is the warm-up
# (compilation, measured from jax.monitoring's compile events and reported separately); then
# both run steps 1..n interleaved (a, b, then b, a, ...), and the split from `train_step`
# (sample incl. reward / p_old forward incl. advantages / updates incl. the first-order meter
# / sampler sync) plus the wall time of the whole step are reported as medians. Ratios A/B: of
# the medians, and the median of the per-round (paired) ratios. The first-order meter runs
# only every M-th step, which a median hides: `--compare meters` also reports the ratio of
# the summed step times over whole multiples of M and the meter's own cost (update time of
# the steps where it ran minus that of the others) as a share of M median steps. Any
# compilation during the timed steps is counted and reported (expected 0). Default: ~3
# minutes on 2 busy CPU cores; --small: ~1 minute.
from __future__ import annotations

if __name__ == "__main__":  # before jax loads: XLA:CPU runs re-exec with tcmalloc / jemalloc preloaded
  from rl_jax import host_memory  # pylint: disable=g-import-not-at-top
  host_memory.reexec_tuned()

import argparse
import dataclasses
import collections
import os
import statistics
import sys
import tempfile
import time

import jax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rl_jax.configs import countdown_tiny  # pylint: disable=g-import-not-at-top,wrong-import-position
from rl_jax.rl.job import RLConfig  # pylint: disable=g-import-not-at-top,wrong-import-position
from rl_jax.rl.trainer import RLTrainer  # pylint: disable=g-import-not-at-top,wrong-import-position

PHASES = ("sample", "p_old", "update", "sync", "sampler_wait", "attribution")
# The step's device-group busy fractions (rl_jax/rl/inflight.py BusyClock, docs/metrics.md).
BUSY = ("sampler_busy", "trainer_busy", "busy_overlap")
TARGET = 1.05          # score centering's full-step target
METER_TARGET = 1.03    # the meters' target at the default M


class NoDriftTrainer(RLTrainer):
  """Drops the sampler's top-k from the batch: the loss computes no drift meter."""

  def prepare(self, ro, rewards, old=None):
    batch, m = super().prepare(ro, rewards, old)
    return batch.replace(topk_ids_BTK=None, topk_logq_BTK=None), m


# name -> (loss.score_centering or None for the config's, rl.meter_every or None for --meter-every,
#          trainer class)
PAIRS = {
    "sc": {"sc": ("topk", 0, RLTrainer), "pg": ("none", 0, RLTrainer)},
    "meters": {"on": (None, None, RLTrainer), "off": (None, 0, RLTrainer)},
    "drift": {"drift": ("none", 0, RLTrainer), "nodrift": ("none", 0, NoDriftTrainer)},
    "mode": {"async": (None, 0, RLTrainer), "sync": (None, 0, RLTrainer)},
    "invariant": {"invariant": (None, 0, RLTrainer), "default": (None, 0, RLTrainer)},
    "attribution": {"attr": (None, 0, RLTrainer), "off": (None, 0, RLTrainer)},
    "p_old": {"inupdate": (None, 0, RLTrainer), "separate": (None, 0, RLTrainer)},
}


class CompileMeter:
  """Counts XLA compilations and their seconds (trace + lower + compile) via jax.monitoring."""

  def __init__(self):
    self.count = 0
    self.seconds = 0.0
    jax.monitoring.register_event_duration_secs_listener(self._on_event)

  def _on_event(self, event: str, duration: float, **_):
    if event.startswith("/jax/core/compile/"):
      self.seconds += duration
      if event.endswith("backend_compile_duration"):
        self.count += 1

  def snapshot(self) -> tuple[int, float]:
    return self.count, self.seconds


def make_config(args, centering: str | None, meter_every: int | None, name: str = ""):
  cfg = countdown_tiny.get_config("test" if args.small else None)
  cfg.warm_start.source = "none"
  cfg.logging.wandb_mode = "disabled"
  cfg.rl.plot = False
  cfg.rl.steps = 10_000  # the async loop generates ahead only up to rl.steps
  cfg.rl.meter_every = args.meter_every if meter_every is None else meter_every
  if centering is not None:
    cfg.loss.score_centering = centering
  cfg.loss.topk = args.k
  cfg.sampler.record_topk = max(cfg.sampler.record_topk, args.k)
  if args.vocab_heavy:
    cfg.model.vocab_size = args.heavy_vocab
  if name == "async":
    if jax.device_count() < 2:
      sys.exit("--compare mode needs >= 2 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8")
    cfg.rl.mode, cfg.rl.max_staleness = "async", 1
    cfg.mesh.sampler_devices = jax.device_count() // 2
  if name in ("invariant", "default"):  # the mode certifies an unquantized fp32 sampler
    cfg.sampler.quant, cfg.sampler.dtype = "none", "float32"
    cfg.model.batch_invariant = name == "invariant"
  if name == "attr":
    cfg.rl.attribution_every = 1
  if name == "separate":
    cfg.rl.p_old_in_update = False
  if name == "sync":  # as many devices as async's trainer: the ratio is the overlap, not the mesh size
    cfg.mesh.num_devices = jax.device_count() // 2
  return cfg


def timed_step(trainer: RLTrainer, step: int) -> dict:
  t0 = time.perf_counter()
  row = trainer.train_step(step)
  out = {p: row.get(f"time/{p}_s", 0.0) for p in PHASES}  # sync_s: sync loop; sampler_wait_s: async
  out.update({b: row.get(f"async/{b}", 0.0) for b in BUSY})
  out["step"] = time.perf_counter() - t0
  return out


def main():
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--small", action="store_true", help="the config's `:test` variant (quick check)")
  p.add_argument("--steps", type=int, default=None,
                 help="timed steps per trainer after the warm-up (default 10, --small 30)")
  p.add_argument("--k", type=int, default=16, help="k of top-k score centering")
  p.add_argument("--vocab-heavy", action="store_true",
                 help="model.vocab_size = --heavy-vocab (ids past the tokenizer's decode to U+FFFD)")
  p.add_argument("--heavy-vocab", type=int, default=8192)
  p.add_argument("--compare", choices=tuple(PAIRS), default="sc",
                 help="sc: top-k score centering vs none; meters: first-order meter every "
                      "--meter-every steps vs off; drift: top-k carried to the loss vs dropped; "
                      "mode: async (K=1, split devices) vs sync; invariant: model.batch_invariant vs "
                      "not; attribution: rl.attribution_every=1 vs off")
  p.add_argument("--meter-every", type=int, default=RLConfig.meter_every,
                 help="M of --compare meters (default: rl.meter_every's default)")
  p.add_argument("--attribution-every", type=int, default=10,
                 help="the rl.attribution_every at which --compare attribution estimates the run's ratio")
  args = p.parse_args()
  steps = args.steps or (30 if args.small else 10)
  if args.compare == "meters":  # whole multiples of M, at least 3 meter calls
    m_every = max(args.meter_every, 1)
    steps = max(m_every * 3, -(-steps // m_every) * m_every)

  meter = CompileMeter()
  pair = PAIRS[args.compare]
  names = tuple(pair)
  a_name, b_name = names
  trainers, build, warm = {}, {}, {}
  with tempfile.TemporaryDirectory(prefix="bench_rl_step_") as root:
    for name in names:
      centering, meter_every, cls = pair[name]
      cfg = make_config(args, centering, meter_every, name)
      c0, s0 = meter.snapshot()
      t0 = time.perf_counter()
      trainers[name] = cls(cfg, os.path.join(root, name))
      c1, s1 = meter.snapshot()
      build[name] = (time.perf_counter() - t0, c1 - c0, s1 - s0)
    job = trainers[a_name].job
    m, rl = job.model, job.rl
    print(f"RL step of configs/countdown_tiny.py{':test' if args.small else ''}: "
          f"{rl.prompts_per_step} prompts x {rl.group_size} completions, "
          f"{job.sampler.max_prompt_len}+{job.sampler.max_new_tokens} tokens, "
          f"{rl.n_minibatches} update(s)/step, sampler quant={cfg.sampler.quant}; "
          f"model V={m.vocab_size} d={m.d_model} layers={m.n_layers} "
          f"(MoE {m.n_moe_layers}, E={m.n_experts}, K={m.n_experts_per_tok}); random init; "
          f"{jax.devices()[0].platform} x{jax.device_count()}")
    for name in names:
      j = trainers[name].job
      print(f"{name}: loss.method={j.loss.method!r} score_centering={j.loss.score_centering!r} "
            f"(k={j.loss.topk}), rl.meter_every={j.rl.meter_every}, {type(trainers[name]).__name__}")
    print(f"sampler.record_topk={job.sampler.record_topk}; optim={job.optim.name}")

    for name in names:  # warm-up step 0: compiles generate / p_old forward / update (/ meter)
      c0, s0 = meter.snapshot()
      tr = trainers[name]
      job = tr.job
      if job.rl.meter_every:  # the meter runs at step 0 too, so its compilation is a warm-up's
        tr.job = dataclasses.replace(job, rl=dataclasses.replace(job.rl, meter_every=1))
      warm[name] = timed_step(tr, 0)
      tr.job = job
      c1, s1 = meter.snapshot()
      warm[name]["compiles"], warm[name]["compile_s"] = c1 - c0, s1 - s0

    times = {name: collections.defaultdict(list) for name in names}
    c0, _ = meter.snapshot()
    for r in range(steps):
      order = names if r % 2 == 0 else names[::-1]
      for name in order:
        for key, v in timed_step(trainers[name], 1 + r).items():
          times[name][key].append(v)
    recompiles = meter.snapshot()[0] - c0
    for t in trainers.values():
      t.ckpt.close()

  med = {n: {k: statistics.median(v) for k, v in times[n].items()} for n in names}
  print("\nCompilation (excluded from the split):")
  print(f"{'trainer':8} {'build s':>8} {'(compiles, s)':>14} {'step-0 s':>9} {'(compiles, s)':>14} "
        f"{'step-0 - median step s':>23}")
  for n in names:
    b, w = build[n], warm[n]
    bc, wc = f"({b[1]}, {b[2]:.1f})", f"({w['compiles']}, {w['compile_s']:.1f})"
    print(f"{n:8} {b[0]:8.2f} {bc:>14} {w['step']:9.2f} {wc:>14} {w['step'] - med[n]['step']:23.2f}")
  print(f"({a_name} is built and stepped first, so it also pays the compilations {b_name} then "
        "reuses: parameter init, sampler sync, generate)")
  print(f"compilations during the {2 * steps} timed steps: {recompiles}"
        + ("" if recompiles == 0 else "  <-- RECOMPILATION (rerun with JAX_LOG_COMPILES=1)"))

  print(f"\nTime split, median of {steps} steps per trainer (seconds), interleaved {a_name}/{b_name}:")
  ratio = f"{a_name.upper()}/{b_name.upper()}"
  print(f"{'phase':8} {a_name:>8} {b_name:>8} {a_name + ' share':>10} {ratio:>9} {'paired':>7}")
  for key in PHASES + ("step",):
    a, b = times[a_name][key], times[b_name][key]
    paired = statistics.median(x / y for x, y in zip(a, b)) if min(b) > 0 else float("nan")
    share = med[a_name][key] / med[a_name]["step"]
    if med[b_name][key] == 0:  # a phase only one of the two has (sync_s / sampler_wait_s)
      print(f"{key:8} {med[a_name][key]:8.4f} {med[b_name][key]:8.4f} {share:10.1%} {'-':>9} {'-':>7}")
      continue
    print(f"{key:8} {med[a_name][key]:8.4f} {med[b_name][key]:8.4f} {share:10.1%} "
          f"{med[a_name][key] / med[b_name][key]:9.3f} {paired:7.3f}")
  full = med[a_name]["step"] / med[b_name]["step"]
  upd = med[a_name]["update"] / med[b_name]["update"]
  target = METER_TARGET if args.compare != "sc" else TARGET
  print(f"\nfull-step ratio {ratio} (medians): {full:.3f}; update-only ratio {ratio}: {upd:.3f}")
  if args.compare == "mode":
    print("  (no target: what overlaps depends on the devices; on simulated CPU devices both groups "
          "share the same cores)")
    print(f"\nDevice busy fractions of the step's wall time, medians ('overlap' = both groups busy; "
          f"upper bounds from [dispatch, observed ready] intervals):")
    print(f"{'trainer':8} {'step s':>8} {'sampler':>8} {'trainer':>8} {'overlap':>8}")
    for n in names:
      print(f"{n:8} {med[n]['step']:8.4f} " + " ".join(f"{med[n][b]:8.3f}" for b in BUSY))
  elif args.compare == "attribution":
    call = med[a_name]["attribution"]
    e = args.attribution_every
    print(f"one attribution call: {call:.4f} s = {call / med[b_name]['step']:.1%} of a median step "
          f"({len(trainers[a_name].programs.learner.attribution_variants)} variants: "
          f"{', '.join(n for n, _, _ in trainers[a_name].programs.learner.attribution_variants)}; "
          f"rl.attribution_rows={trainers[a_name].job.rl.attribution_rows}); every {e} steps: ratio "
          f"{1.0 + call / (e * med[b_name]['step']):.3f} (no target: a diagnostic's cost, set by its period)")
  elif args.compare == "p_old":
    print("  (no target: the step saves one forward over the global batch; issue 54's targets are the step's)")
  elif args.compare == "invariant":
    print("  (no target: the mode is a certificate, not a training setting; its cost is the per-slot "
          "attention loop and the router's ordered accumulation)")
  elif args.compare != "meters":
    print(f"  (target <= {target}: {'met' if full <= target else 'MISSED'})")
  else:
    m_every = trainers[a_name].job.rl.meter_every
    total = sum(times[a_name]["step"]) / sum(times[b_name]["step"])
    ran = [r for r in range(steps) if (2 + r) % m_every == 0]   # step index 1 + r, done = 2 + r
    rest = [r for r in range(steps) if (2 + r) % m_every != 0]
    upd_a = times[a_name]["update"]
    extra = statistics.median(upd_a[r] for r in ran) - statistics.median(upd_a[r] for r in rest)
    est = 1.0 + extra / (m_every * med[b_name]["step"])
    print(f"summed over {steps} steps ({len(ran)} meter calls, M={m_every}): ON/OFF {total:.3f}")
    default_m = RLConfig.meter_every
    if m_every != default_m:
      print(f"at the default M={default_m}: ratio {1.0 + extra / (default_m * med[b_name]['step']):.3f}")
    print(f"the meter's own cost: {extra:.4f} s per call (update time of the steps it ran in minus "
          f"the others, medians) = {extra / med[b_name]['step']:.1%} of a median step; every M={m_every} "
          f"steps: ratio {est:.3f} (target <= {target}: {'met' if est <= target else 'MISSED'})")
  aa = med[a_name]["sample"] / med[b_name]["sample"]
  if args.compare == "invariant":  # the sampler differs too: no phase is a control
    print("noise control: none here (the mode changes the sampler's work as well as the trainer's)")
  else:
    print(f"noise control: 'sample' does nearly the same work in both trainers (same sampler "
        f"settings, prompts and keys; the policies differ), so its {ratio} {aa:.3f} shows this machine's noise floor")
  print("('step' = wall time of train_step; the four phases are its own timers, the rest is "
        "host-side metric gathering. 'paired' = median of the per-round ratios.)")

if __name__ == "__main__":
  main()
