"""Sweeps: (name, overrides) grids of single runs over configs/countdown_tiny.py, and the override vocabulary.

The run grids' one home is this package: a sweep here is a flat list of runs (one seed each,
printed as commands); a study (`studies.py`) is panels x lines x seeds, built on the regimes and
`apply_overrides` defined here. Overrides are dotted config keys; a dict value replaces a whole
section.

Usage:
  python -m rl_jax.study.sweeps              # lists the sweeps (also: python -m configs.sweeps)
  python -m rl_jax.study.sweeps mismatch [--root=/tmp/rl_jax_sweeps] [--warm_start=DIR] | sh

Each run is `python -m rl_jax.main --config=configs/countdown_tiny.py --workdir=ROOT/SWEEP/NAME
--config.a.b=v ...`. ml_collections only overrides keys the config file has, with values
of their type, so two kinds of run use configs/sweeps.py as the config instead,
`--config=configs/sweeps.py:SWEEP/NAME` (its `get_config` is this module's: the same
countdown_tiny config with the same overrides): the two quantization regimes whose presets'
block sizes do not fit the tiny model (head_dim 16, d_model 64), which need a whole
`sampler.quant` section in place of the preset name.

`--warm_start=DIR` makes every run reuse one SFT warm start in DIR (produced by the
first run that finds none: run that one alone, or first run
`python -m rl_jax.main --config=configs/sft_countdown_tiny.py --workdir=DIR`);
without it every run trains its own (a few CPU minutes each).
"""
from __future__ import annotations

import argparse
import copy
import shlex
import sys
from typing import Any, Callable

import ml_collections

from rl_jax.configs import countdown_tiny
from rl_jax.configs import qwen3_30b_a3b_minirl
from rl_jax.rl.loss.loss_config import registered_methods  # every registered loss method, in registration order

BASE = "configs/countdown_tiny.py"
THIS = "configs/sweeps.py"   # the config file whose get_config is this module's
Overrides = dict[str, Any]   # dotted config key -> value (a dict value replaces a whole section)
Sweep = list[tuple[str, Overrides]]

# The tiny model's vocabulary: full score centering records the sampler's whole distribution.
TINY_VOCAB = 80

# MiniRL as [MiniRL] defines it (Eq. 7): no score centering, no length normalization.
MINIRL: Overrides = {"loss.method": "minirl", "loss.score_centering": "none",
                     "loss.aggregation": "constant"}
REPLAY_FOR_N = qwen3_30b_a3b_minirl.REPLAY_FOR_N   # [MiniRL]'s recommendation

# [SC]'s four sampler regimes plus weight-only ones, as sections that fit the tiny model.
# FP4 KV: the MXFP4 preset's 32-element blocks do not divide head_dim 16; 16-element
# blocks are NVFP4's size. INT4 weights: the preset's GPTQ groups of 128 exceed the
# 64-wide contraction dims; 32 is the smallest common GPTQ/AWQ group size.
_FP8_WA = {"weights": {"format": "fp8"}, "activations": {"format": "fp8"}}
QUANT_REGIMES: dict[str, Any] = {
    "fp8_wa_fp8_kv": "fp8_wa_fp8_kv",
    "fp8_wa_fp4_kv": dict(_FP8_WA, kv={"format": "fp4", "block_size": 16}),
    "int8_wa_int4_kv": "int8_wa_int4_kv",
    "int8_wa_int8_kv": "int8_wa_int8_kv",
    "int4_w": {"weights": {"format": "int4", "granularity": "block", "block_size": 32}},
    "fp4_w": "fp4_w",
    # Every role in FP4 (E2M1): the most severe sampler the formats allow, for calibration.
    "fp4_wa_fp4_kv": {"weights": {"format": "fp4"}, "activations": {"format": "fp4"},
                      "kv": {"format": "fp4", "block_size": 16}},
}
NOISE_SIGMAS = (0.01, 0.02, 0.05)
STALENESS = 64


def methods() -> Sweep:
  """Every correction method (docs/math.md#correction-methods), no score centering, base INT8/INT4 sampler."""
  out = []
  for m in registered_methods():
    o = {"loss.method": m, "loss.score_centering": "none"}
    if m == "minirl":
      o.update(MINIRL)
    out.append((m, o))
  return out


def minirl_ablations(n: int = 4) -> Sweep:
  """[MiniRL]'s ablations at N mini-batches (off-policy, where the mask and replay matter)."""
  base = dict(MINIRL, **{"rl.n_minibatches": n, "rl.routing_replay": REPLAY_FOR_N[n]})
  return [
      ("minirl", base),
      ("no_train_infer_is", dict(base, **{"loss.minirl_train_infer_is": False})),
      ("length_norm", dict(base, **{"loss.aggregation": "seq_mean"})),
      ("no_clip", dict(base, **{"loss.minirl_clip": False})),
      *[(f"replay_{r}", dict(base, **{"rl.routing_replay": r}))
        for r in ("none", "R2", "R3") if r != REPLAY_FOR_N[n]],
  ]


def score_centering() -> Sweep:
  """[SC]'s SC variants: none / top-k (k = 4, 16) / full, and SC composed with TIS and MIS."""
  pg = {"loss.method": "pg"}
  return [
      ("none", dict(pg, **{"loss.score_centering": "none"})),
      ("topk16", dict(pg, **{"loss.score_centering": "topk", "loss.topk": 16})),
      ("topk4", dict(pg, **{"loss.score_centering": "topk", "loss.topk": 4})),
      ("full", dict(pg, **{"loss.score_centering": "full", "sampler.record_topk": TINY_VOCAB})),
      ("tis", {"loss.method": "tis", "loss.score_centering": "none"}),
      ("topk16_tis", {"loss.method": "tis", "loss.score_centering": "topk", "loss.topk": 16}),
      ("mis", {"loss.method": "mis", "loss.score_centering": "none"}),
      ("topk16_mis", {"loss.method": "mis", "loss.score_centering": "topk", "loss.topk": 16}),
  ]


def mismatch() -> Sweep:
  """Every mismatch source (docs/math.md#mismatch-sources) with the base loss (PG + top-k SC).

  Quantization, noise, staleness.

  Noise and staleness runs use an fp32 sampler so that only that source is present.
  With K=64 the base 160 steps would refresh the sampler only twice: those runs take 192
  steps (three whole sampler periods, ~1.2x the base runtime).
  """
  out: Sweep = [("fp32", {"sampler.quant": "none"})]
  out += [(name, {"sampler.quant": q}) for name, q in QUANT_REGIMES.items()]
  out += [(f"noise_{s}", {"sampler.quant": "none", "sampler.noise": "relative", "sampler.noise_sigma": s})
          for s in NOISE_SIGMAS]
  out.append((f"stale_{STALENESS}", {"sampler.quant": "none", "rl.staleness": STALENESS,
                                     "rl.steps": 3 * STALENESS}))
  return out


def off_policy() -> Sweep:
  """MiniRL at N in {1, 2, 4, 8} mini-batches per global batch, each with [MiniRL]'s replay mode."""
  return [(f"n{n}_{r}", dict(MINIRL, **{"rl.n_minibatches": n, "rl.routing_replay": r}))
          for n, r in REPLAY_FOR_N.items()]


def replay(n: int = 4) -> Sweep:
  """Routing replay none / R2 / R3 with MiniRL at N mini-batches."""
  return [(r, dict(MINIRL, **{"rl.n_minibatches": n, "rl.routing_replay": r})) for r in ("none", "R2", "R3")]


def regimes_x_corrections() -> Sweep:
  """[SC]'s figure grid: each mismatch regime x {PG, TIS, MIS, SC, SC+TIS, SC+MIS}."""
  corrections = {
      "pg": {"loss.method": "pg", "loss.score_centering": "none"},
      "tis": {"loss.method": "tis", "loss.score_centering": "none"},
      "mis": {"loss.method": "mis", "loss.score_centering": "none"},
      "sc": {"loss.method": "pg", "loss.score_centering": "topk"},
      "sc_tis": {"loss.method": "tis", "loss.score_centering": "topk"},
      "sc_mis": {"loss.method": "mis", "loss.score_centering": "topk"},
  }
  return [(f"{regime}/{c}", dict(ro, **co)) for regime, ro in mismatch() for c, co in corrections.items()]


SWEEPS: dict[str, Callable[[], Sweep]] = {
    "methods": methods,
    "minirl_ablations": minirl_ablations,
    "score_centering": score_centering,
    "mismatch": mismatch,
    "off_policy": off_policy,
    "replay": replay,
    "regimes_x_corrections": regimes_x_corrections,
}


def apply_overrides(config: ml_collections.ConfigDict, overrides: Overrides) -> ml_collections.ConfigDict:
  """A copy of `config` with `overrides` set.

  A key the section does not list yet is added; a misspelt one is then rejected by the
  job's validator (`RLJob.from_config` names unknown keys), never silently ignored.
  """
  config = copy.deepcopy(config)
  for key, value in overrides.items():
    *parents, leaf = key.split(".")
    node = config
    for p in parents:
      node = node[p]
    if isinstance(value, dict):
      value = ml_collections.ConfigDict(value)
      if leaf in node and not isinstance(node[leaf], ml_collections.ConfigDict):
        # A section replacing a preset name: ConfigDict is type-safe, so drop the old field first.
        del node[leaf]
    node[leaf] = value
  return config


def flag_expressible(overrides: Overrides, base: ml_collections.ConfigDict | None = None) -> bool:
  """Whether `--config.a.b=v` flags can express `overrides` on the base config.

  ml_collections only overrides keys the config file already has, with a value of their
  type: a new key or a section in place of a string needs this file as the config.
  """
  base = countdown_tiny.get_config() if base is None else base
  for key, value in overrides.items():
    node = base
    for part in key.split("."):
      if not isinstance(node, ml_collections.ConfigDict) or part not in node:
        return False
      node = node[part]
    if isinstance(value, dict) or isinstance(node, ml_collections.ConfigDict):
      return False
  return True


def entry(sweep: str, name: str) -> Overrides:
  runs = dict(SWEEPS[sweep]())
  if name not in runs:
    raise KeyError(f"sweep {sweep!r} has no run {name!r}; runs: {sorted(runs)}")
  return runs[name]


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """countdown_tiny with one sweep run's overrides; arg 'SWEEP/NAME' (e.g. 'mismatch/int4_w')."""
  sweep, sep, name = (arg or "").partition("/")
  if not sep or sweep not in SWEEPS:
    raise ValueError(f"config arg {arg!r}: expected 'SWEEP/NAME' with SWEEP in {sorted(SWEEPS)}")
  return apply_overrides(countdown_tiny.get_config(), entry(sweep, name))


def _flag_value(v: Any) -> str:
  return repr(v) if isinstance(v, float) else str(v)


def command(sweep: str, name: str, overrides: Overrides, root: str, warm_start: str | None = None) -> str:
  """The shell command of one run: flag overrides of countdown_tiny, or this file for section overrides."""
  args = ["python", "-m", "rl_jax.main"]
  if not flag_expressible(overrides):
    args += [f"--config={THIS}:{sweep}/{name}", f"--workdir={root}/{sweep}/{name}"]
  else:
    args += [f"--config={BASE}", f"--workdir={root}/{sweep}/{name}"]
    args += [f"--config.{k}={_flag_value(v)}" for k, v in overrides.items()]
  if warm_start:
    args.append(f"--config.warm_start.path={warm_start}")
  return " ".join(shlex.quote(a) for a in args)


def commands(sweep: str, root: str = "/tmp/rl_jax_sweeps", warm_start: str | None = None) -> list[str]:
  return [command(sweep, name, o, root, warm_start) for name, o in SWEEPS[sweep]()]


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m rl_jax.study.sweeps", description=__doc__.split("\n")[0])
  parser.add_argument("sweep", nargs="?", choices=sorted(SWEEPS))
  parser.add_argument("--root", default="/tmp/rl_jax_sweeps", help="workdirs are ROOT/SWEEP/NAME")
  parser.add_argument("--warm_start", default=None, help="shared SFT warm-start directory")
  args = parser.parse_args(argv)
  if args.sweep is None:
    for name, fn in SWEEPS.items():
      print(f"{name:24s} {len(fn()):3d} runs  {(fn.__doc__ or '').splitlines()[0]}")
    return 0
  for line in commands(args.sweep, args.root, args.warm_start):
    print(line)
  return 0


if __name__ == "__main__":
  sys.exit(main())
