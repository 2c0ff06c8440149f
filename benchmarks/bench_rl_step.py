"""Time split of one RL step of configs/countdown_tiny.py and the overhead of top-k score centering."""
# Usage:
#   python benchmarks/bench_rl_step.py                 # the README config (32 x 8, INT8/INT4 sampler)
#   python benchmarks/bench_rl_step.py --small         # its `:test` variant (4 x 2, 2-layer model)
#   python benchmarks/bench_rl_step.py --vocab-heavy   # the same with an 8192-token vocabulary
#
# Two `RLTrainer`s are built from the config with warm_start.source='none' (random init:
# timing only), wandb disabled, in a temporary workdir: "sc" with
# loss.score_centering='topk' (k=16) and "pg" with 'none' (plain policy gradient). The
# loss config is baked into each trainer's jitted update, hence two trainers; both keep
# the same sampler settings, prompts and keys (top-k still recorded), so the difference is
# the loss (the rollouts themselves diverge after step 1, as the two policies do). Step 0 of each is the warm-up (compilation, measured from jax.monitoring's
# compile events and reported separately); then both run steps 1..n interleaved
# (sc, pg, then pg, sc, ...), and the split from `train_step` (sample incl. reward /
# p_old forward incl. advantages / updates / sampler sync) plus the wall time of the
# whole step are reported as medians. Ratios SC/PG: of the medians, and the median of the
# per-round (paired) ratios. Any compilation during the timed steps is counted and
# reported (expected 0). Default: ~3 minutes on 2 busy CPU cores; --small: ~1 minute.
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
import time

import jax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from configs import countdown_tiny  # pylint: disable=g-import-not-at-top,wrong-import-position
from rl_jax.rl.trainer import RLTrainer  # pylint: disable=g-import-not-at-top,wrong-import-position

PHASES = ("sample", "p_old", "update", "sync")
TARGET = 1.05


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


def make_config(args, centering: str):
  cfg = countdown_tiny.get_config("test" if args.small else None)
  cfg.warm_start.source = "none"
  cfg.logging.wandb_mode = "disabled"
  cfg.rl.plot = False
  cfg.loss.score_centering = centering
  cfg.loss.topk = args.k
  cfg.sampler.record_topk = max(cfg.sampler.record_topk, args.k)
  if args.vocab_heavy:
    cfg.model.vocab_size = args.heavy_vocab
  return cfg


def timed_step(trainer: RLTrainer, step: int) -> dict:
  t0 = time.perf_counter()
  row = trainer.train_step(step)
  out = {p: row[f"time/{p}_s"] for p in PHASES}
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
  args = p.parse_args()
  steps = args.steps or (30 if args.small else 10)

  meter = CompileMeter()
  names = ("sc", "pg")
  centering = {"sc": "topk", "pg": "none"}
  trainers, build, warm = {}, {}, {}
  with tempfile.TemporaryDirectory(prefix="bench_rl_step_") as root:
    for name in names:
      cfg = make_config(args, centering[name])
      c0, s0 = meter.snapshot()
      t0 = time.perf_counter()
      trainers[name] = RLTrainer(cfg, os.path.join(root, name))
      c1, s1 = meter.snapshot()
      build[name] = (time.perf_counter() - t0, c1 - c0, s1 - s0)
    job = trainers["sc"].job
    m, rl = job.model, job.rl
    print(f"RL step of configs/countdown_tiny.py{':test' if args.small else ''}: "
          f"{rl.prompts_per_step} prompts x {rl.group_size} completions, "
          f"{job.sampler.max_prompt_len}+{job.sampler.max_new_tokens} tokens, "
          f"{rl.n_minibatches} update(s)/step, sampler quant={cfg.sampler.quant}; "
          f"model V={m.vocab_size} d={m.d_model} layers={m.n_layers} "
          f"(MoE {m.n_moe_layers}, E={m.n_experts}, K={m.n_experts_per_tok}); random init; "
          f"{jax.devices()[0].platform} x{jax.device_count()}")
    print(f"sc: loss.score_centering='topk' k={args.k} (sampler.record_topk="
          f"{job.sampler.record_topk}); pg: 'none'; otherwise the config's loss (method="
          f"{job.loss.method!r}) and sampler for both; optim={job.optim.name}")

    for name in names:  # warm-up step 0: compiles generate / p_old forward / update
      c0, s0 = meter.snapshot()
      warm[name] = timed_step(trainers[name], 0)
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
  print("(sc is built and stepped first, so it also pays the compilations pg then reuses: "
        "parameter init, sampler sync, generate)")
  print(f"compilations during the {2 * steps} timed steps: {recompiles}"
        + ("" if recompiles == 0 else "  <-- RECOMPILATION (rerun with JAX_LOG_COMPILES=1)"))

  print(f"\nTime split, median of {steps} steps per trainer (seconds), interleaved sc/pg:")
  print(f"{'phase':8} {'sc':>8} {'pg':>8} {'sc share':>9} {'SC/PG':>7} {'paired':>7}")
  for key in PHASES + ("step",):
    a, b = times["sc"][key], times["pg"][key]
    paired = statistics.median(x / y for x, y in zip(a, b)) if min(b) > 0 else float("nan")
    share = med["sc"][key] / med["sc"]["step"]
    print(f"{key:8} {med['sc'][key]:8.4f} {med['pg'][key]:8.4f} {share:9.1%} "
          f"{med['sc'][key] / med['pg'][key]:7.3f} {paired:7.3f}")
  full = med["sc"]["step"] / med["pg"]["step"]
  upd = med["sc"]["update"] / med["pg"]["update"]
  print(f"\nfull-step ratio SC/PG: {full:.3f} (target <= {TARGET}: "
        f"{'met' if full <= TARGET else 'MISSED'}); update-only ratio SC/PG: {upd:.3f}")
  aa = med["sc"]["sample"] / med["pg"]["sample"]
  print(f"noise control: 'sample' does nearly the same work in both trainers (same sampler "
        f"settings, prompts and keys; the policies differ), so its SC/PG {aa:.3f} shows this machine's noise floor")
  print("('step' = wall time of train_step; the four phases are its own timers, the rest is "
        "host-side metric gathering. 'paired' = median of the per-round ratios.)")


if __name__ == "__main__":
  main()
