"""The MoE dispatch's stable sort by expert: `expert_rows._sort_by_expert` (counting where it pays) against argsort.

Usage:
  PYTHONPATH=. python benchmarks/bench_expert_sort.py [--reps 20]

Per (assignments M, groups = experts + 1): both jitted, checked equal (order and rank), the median
of `--reps` calls each, and the ratio counting / argsort (< 1: the counting sort wins). The first
row is the study model's update (256 rows x 36 slots x top-2, 4 experts).
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from rl_jax.models import expert_rows

CASES = ((18432, 5), (73728, 9), (512, 5), (32768, 129))


def _argsort(ids, n_groups):
  del n_groups
  order = jnp.argsort(ids, stable=True).astype(jnp.int32)
  return order, jnp.zeros_like(order).at[order].set(jnp.arange(ids.shape[0], dtype=jnp.int32))


def _median_s(fn, ids, reps: int) -> float:
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(ids))
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--reps", type=int, default=20)
  args = ap.parse_args()
  print(f"{'M':>7} {'groups':>6} {'argsort ms':>11} {'_sort_by_expert ms':>19} {'ratio':>6}")
  for m, g in CASES:
    ids = jnp.asarray(np.random.default_rng(0).integers(0, g, m), jnp.int32)
    fns = {k: jax.jit(lambda x, f=f: f(x, g)) for k, f in (("sort", _argsort), ("ours", expert_rows._sort_by_expert))}  # pylint: disable=protected-access
    outs = {k: jax.block_until_ready(f(ids)) for k, f in fns.items()}
    assert all(np.array_equal(a, b) for a, b in zip(outs["sort"], outs["ours"])), (m, g)
    t = {k: _median_s(f, ids, args.reps) for k, f in fns.items()}
    print(f"{m:7d} {g:6d} {t['sort'] * 1e3:11.3f} {t['ours'] * 1e3:19.3f} {t['ours'] / t['sort']:6.2f}x")


if __name__ == "__main__":
  main()
