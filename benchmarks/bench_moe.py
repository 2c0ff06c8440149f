"""Forward+backward time of one MoE layer: capacity-slab and `lax.ragged_dot` dropless experts vs every expert dense."""
# Usage:
#   python benchmarks/bench_moe.py            # N=4096 tokens, d_model=512, moe_d_ff=1024, E=8, K=2
#   python benchmarks/bench_moe.py --small    # N=512, d_model=128, moe_d_ff=256: seconds
#
# Both paths route with `rl_jax.models.moe.route` (float32 softmax router, top-K,
# renormalized gates). "capacity" is the model's own `dropless_experts`: an [E, C, D]
# slab of each expert's tokens (C = 2x the mean load) and three batched matmuls, with
# `ragged_experts` as the exact fallback when routing overflows C. "ragged" is
# `ragged_experts`: (token, slot) pairs sorted by expert and three `lax.ragged_dot`s. "dense" computes the SwiGLU of
# EVERY expert for EVERY token ([E, N, F] intermediates) and combines them with the
# gate weights scattered to [N, E] (zero outside the top-K): the same math, E/K times
# the useful FLOPs. The timed function is value_and_grad of sum(y * ct) w.r.t. x, the
# router and the three expert weights; outputs and gradients are checked to agree
# before timing. Both are compiled ahead of time (compile times reported), warmed up,
# then timed round by round, alternating which goes first, so a machine shared with
# other work slows them alike; medians (and minima) of the rounds are reported.
# XLA's FLOP count of each compiled program is printed too: `ragged_dot` has no native
# CPU kernel, and its generic lowering masks the N*K sorted rows once per expert, i.e. K
# times the dense path's FLOPs (E times the useful ones). Default size: ~6-8 minutes on
# 2 busy CPU cores (each round ~45 s); --small: ~20 s.
from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from rl_jax.models.moe import dropless_experts, ragged_experts, route


def _inputs(args):
  """Random float32 layer inputs (numpy's generator), every one a jit argument."""
  rng = np.random.default_rng(args.seed)
  n, d, f, e = args.N, args.D, args.F, args.E
  std = 0.05
  data = dict(
      x=rng.standard_normal((n, d), dtype=np.float32),
      w_router=std * rng.standard_normal((d, e), dtype=np.float32),
      w_gate=std * rng.standard_normal((e, d, f), dtype=np.float32),
      w_up=std * rng.standard_normal((e, d, f), dtype=np.float32),
      w_down=std * rng.standard_normal((e, f, d), dtype=np.float32),
      ct=rng.standard_normal((n, d), dtype=np.float32),
  )
  return {k: jnp.asarray(v) for k, v in data.items()}


def ragged_layer(x, w_router, w_gate, w_up, w_down, *, k: int):
  e = w_router.shape[1]
  ids, gates, _, _ = route(x @ w_router, k, True)
  return ragged_experts(x, ids, gates, w_gate, w_up, w_down, e)


def capacity_layer(x, w_router, w_gate, w_up, w_down, *, k: int):
  e = w_router.shape[1]
  ids, gates, _, _ = route(x @ w_router, k, True)
  return dropless_experts(x, ids, gates, w_gate, w_up, w_down, e)


def dense_layer(x, w_router, w_gate, w_up, w_down, *, k: int):
  e = w_router.shape[1]
  ids, gates, _, _ = route(x @ w_router, k, True)
  gates_NE = jnp.einsum("nke,nk->ne", jax.nn.one_hot(ids, e, dtype=gates.dtype), gates)
  h_ENF = (jax.nn.silu(jnp.einsum("nd,edf->enf", x, w_gate))
           * jnp.einsum("nd,edf->enf", x, w_up))
  y_END = jnp.einsum("enf,efd->end", h_ENF, w_down)
  return jnp.einsum("end,ne->nd", y_END, gates_NE.astype(y_END.dtype))


def _step(layer, k: int):
  def loss(x, w_router, w_gate, w_up, w_down, ct):
    y = layer(x, w_router, w_gate, w_up, w_down, k=k)
    return jnp.sum(y * ct), y
  return jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)


def _check(out_r, out_d, rtol: float = 1e-4):
  """Outputs and every gradient agree to float32 tolerance (relative to each array's scale)."""
  (lr, yr), gr = out_r
  (ld, yd), gd = out_d
  names = ("y", "dx", "dw_router", "dw_gate", "dw_up", "dw_down")
  worst = {}
  for name, a, b in zip(names, (yr,) + tuple(gr), (yd,) + tuple(gd)):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = max(np.max(np.abs(b)), 1e-30)
    err = float(np.max(np.abs(a - b)) / scale)
    worst[name] = err
    assert err <= rtol, f"{name}: ragged vs dense max |diff| / max |dense| = {err:.3g} > {rtol}"
  rel_loss = abs(float(lr) - float(ld)) / max(abs(float(ld)), 1e-30)
  assert rel_loss <= rtol, f"loss: relative difference {rel_loss:.3g} > {rtol}"
  return worst


def _flops(compiled) -> float | None:
  try:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost["flops"])
  except Exception:  # pylint: disable=broad-except
    return None


def main():
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--small", action="store_true", help="N=512, D=128, F=256 (quick check)")
  p.add_argument("--N", type=int, default=4096, help="tokens")
  p.add_argument("--D", type=int, default=512, help="d_model")
  p.add_argument("--F", type=int, default=1024, help="moe_d_ff")
  p.add_argument("--E", type=int, default=8, help="experts")
  p.add_argument("--K", type=int, default=2, help="experts per token")
  p.add_argument("--repeats", type=int, default=5, help="timed rounds (each runs every path)")
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args()
  if args.small:
    args.N, args.D, args.F = 512, 128, 256
    args.repeats = max(args.repeats, 10)

  data = _inputs(args)
  operands = tuple(data[n] for n in ("x", "w_router", "w_gate", "w_up", "w_down", "ct"))
  print(f"MoE layer fwd+bwd: N={args.N} tokens, d_model={args.D}, moe_d_ff={args.F}, "
        f"E={args.E}, K={args.K}, float32, {jax.devices()[0].platform} "
        f"({jax.device_count()} device(s))")

  compiled, compile_s, flops = {}, {}, {}
  for name, layer in (("ragged", ragged_layer), ("capacity", capacity_layer), ("dense", dense_layer)):
    t0 = time.perf_counter()
    compiled[name] = jax.jit(_step(layer, args.K)).lower(*operands).compile()
    compile_s[name] = time.perf_counter() - t0
    flops[name] = _flops(compiled[name])

  outs = {name: jax.block_until_ready(fn(*operands)) for name, fn in compiled.items()}  # warm-up
  worst = _check(outs["ragged"], outs["dense"])
  _check(outs["capacity"], outs["dense"])
  ids, _, _, _ = route(data["x"] @ data["w_router"], args.K, True)
  counts = np.bincount(np.asarray(ids).reshape(-1), minlength=args.E)
  print("outputs and gradients agree (max |ragged - dense| / max |dense|): "
        + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))
  print(f"tokens per expert: {counts.tolist()} (N*K = {args.N * args.K})")

  times = {name: [] for name in compiled}
  for r in range(args.repeats):
    names = list(compiled)
    order = names[r % 3:] + names[:r % 3]  # rotate which goes first
    for name in order:
      t0 = time.perf_counter()
      jax.block_until_ready(compiled[name](*operands))
      times[name].append(time.perf_counter() - t0)

  # 3 matmuls of 2*N*K*D*F FLOPs forward; the backward costs twice the forward.
  useful_fb = 3 * (3 * 2 * args.N * args.K * args.D * args.F)
  print(f"{'path':8} {'median s':>9} {'min s':>9} {'compile s':>10} {'XLA GFLOP':>10}")
  for name in ("ragged", "capacity", "dense"):
    f = f"{flops[name] / 1e9:10.1f}" if flops[name] is not None else f"{'n/a':>10}"
    print(f"{name:8} {statistics.median(times[name]):9.4f} {min(times[name]):9.4f} "
          f"{compile_s[name]:10.2f} {f}")
  med = {k: statistics.median(v) for k, v in times.items()}
  mins = {k: min(v) for k, v in times.items()}
  print(f"ratio dense / ragged: median {med['dense'] / med['ragged']:.3f}, "
        f"min {mins['dense'] / mins['ragged']:.3f}  (> 1: ragged is faster)")
  print(f"ratio ragged / capacity: median {med['ragged'] / med['capacity']:.3f}, "
        f"min {mins['ragged'] / mins['capacity']:.3f}  (> 1: capacity is faster)")
  print(f"useful expert FLOPs (fwd+bwd, top-K only): {useful_fb / 1e9:.1f} GFLOP; dense computes "
        f"E/K = {args.E / args.K:g}x that. {args.repeats} interleaved rounds.")


if __name__ == "__main__":
  main()
