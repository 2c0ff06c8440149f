"""An RL run's summary.json (and its end-of-run figure) from its metrics rows."""
from __future__ import annotations

import json

import jax
import numpy as np

from rl_jax import artifacts
from rl_jax.rl import inflight_updates
from rl_jax.rl import plots


def summarize(rows: list[dict]) -> dict:
  """The run's summary from metrics.jsonl's rows (each step once, so means are over the run's steps)."""
  evals = [r for r in rows if "eval_greedy_accuracy" in r]
  summary = {}
  for name in ("greedy_accuracy", "sampled_accuracy", "pass_at_k"):
    have = [r[f"eval_{name}"] for r in evals if f"eval_{name}" in r]
    if have:  # the first eval is the warm start's (step 0)
      summary.update({f"start_eval_{name}": have[0], f"final_eval_{name}": have[-1],
                      f"gain_eval_{name}": have[-1] - have[0]})
  train = [r for r in rows if "reward" in r]
  if train:
    summary.update(final_reward=train[-1]["reward"], mean_kl_k1=float(np.mean([r["mismatch/kl_k1"] for r in train])),
                   steps=train[-1]["step"])
    attributed = [r for r in train if "attribution/total/kl" in r]
    if attributed:  # per source its mean KL(q_s || p) over the steps that attributed
      keys = dict.fromkeys(k for r in attributed for k in r if k.startswith("attribution/") and k.endswith("/kl"))
      summary["attribution_kl"] = {k.split("/")[1]: float(np.mean([r[k] for r in attributed if k in r]))
                                   for k in keys}
    if any(r.get("async/lag") for r in train):
      # The version-lag distribution: steps per lag, and the share of response tokens at each
      # (every row of a step shares its rollout's lag; tokens = mean length x rows).
      lags = [int(r.get("async/lag", 0)) for r in train]
      tokens = np.asarray([r["response_length"] for r in train])
      summary["lag_steps"] = {str(k): lags.count(k) for k in sorted(set(lags))}
      summary["lag_token_share"] = {str(k): float(tokens[np.asarray(lags) == k].sum() / tokens.sum())
                                    for k in sorted(set(lags))}
    summary.update(inflight_updates.summary(train))   # in-flight updates: the tokens' lags
    busy = [r for r in train if "async/sampler_busy" in r]
    if len(busy) > 1:  # step 1 onwards: the first step's spans include compilation
      busy = busy[1:]
    for key in ("sampler_busy", "trainer_busy", "busy_overlap"):
      if busy:
        summary[f"{key}_mean"] = float(np.mean([r[f"async/{key}"] for r in busy]))
    if any("async/dropped" in r for r in train):
      summary["async_dropped_total"] = int(sum(r.get("async/dropped", 0) for r in train))
      summary["async_waits_total"] = int(sum(r.get("async/waits", 0) for r in train))
  return summary


def write(run_dir, rows: list[dict], plot: bool) -> dict:
  """`summarize(rows)`, written (process 0) to the run's summary.json with `rl_curves.png` (`plot`)
  and printed on one line; returned on every process."""
  summary = summarize(rows)
  if jax.process_index() == 0:
    run_dir.path(artifacts.SUMMARY).write_text(json.dumps(summary, indent=1))
    if plot and rows:
      plots.plot_run(rows, run_dir.path("rl_curves.png"))
    print("[rl] " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                              for k, v in summary.items()))
  return summary
