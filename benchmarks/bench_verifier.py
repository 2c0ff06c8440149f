"""Cost per verifier call: the sandboxed worker pool against a plain in-process call (the baseline), as ratios."""
# Usage:
#   python benchmarks/bench_verifier.py              # 400 math calls, pools of 1 and 2 workers
#   python benchmarks/bench_verifier.py --n 100 --workers 1 2 4
#
# Completions are short worked solutions ending in a \boxed{} fraction (the demo's shape, ~60
# characters), half correct. The baseline calls the math verifier in this process with no bound;
# each pool row times `Pool.run` over the same calls after a warm-up (workers started, sympy
# imported), so the figure is the pipe round trip + the verifier, spread over the workers.
# Rounds alternate baseline and pools, so a shared machine slows both alike; medians reported.
from __future__ import annotations

import argparse
import os
import statistics
import time

from rl_jax.tasks import sandbox
from rl_jax.tasks import verifiers


def _calls(n: int) -> list[tuple[str, list]]:
  out = []
  for i in range(n):
    a, b = i + 3, 2 * i + 5
    truth = f"\\frac{{{a}}}{{{b}}}"
    shown = f"\\frac{{{2 * a}}}{{{2 * b}}}" if i % 2 == 0 else f"\\frac{{{a + 1}}}{{{b}}}"
    out.append(("math", ["bench", f"{a}/{b} doubled is the same. So \\boxed{{{shown}}}", truth, {}]))
  return out


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--n", type=int, default=400)
  ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
  ap.add_argument("--rounds", type=int, default=3)
  a = ap.parse_args()
  calls = _calls(a.n)
  pools = {w: sandbox.Pool(workers=w, timeout_s=10.0, memory_mb=2048) for w in a.workers}
  for p in pools.values():
    p.run(calls[:8])
  verifiers.call_local(calls[0][0], *calls[0][1])  # imports sympy / math-verify here too
  times = {"in-process": [], **{f"pool x{w}": [] for w in pools}}
  want = None
  for r in range(a.rounds):
    order = list(times) if r % 2 == 0 else list(times)[::-1]
    for name in order:
      t = time.perf_counter()
      if name == "in-process":
        got = [verifiers.call_local(spec, *args) for spec, args in calls]
      else:
        got = pools[int(name.split("x")[1])].run(calls)
      times[name].append((time.perf_counter() - t) / a.n)
      want = want or got
      assert got == want, name
  base = statistics.median(times["in-process"])
  print(f"{a.n} math-verify calls, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
  for name, ts in times.items():
    m = statistics.median(ts)
    print(f"  {name:11s} {m * 1e3:7.3f} ms/call   x{m / base:5.2f} of in-process")
  for p in pools.values():
    p.close()


if __name__ == "__main__":
  main()
