"""Held-out evaluation of the RL policy: greedy accuracy and outcome breakdown, mean@k, pass@k."""
from __future__ import annotations

import collections
from typing import Any, Callable

import jax
import numpy as np

from rl_jax import rollout as rollout_lib


def pass_at_k(rewards_NK: np.ndarray) -> float:
  """Fraction of prompts (rows) with at least one correct (reward >= 1) of their k samples."""
  return float((np.asarray(rewards_NK) >= 1.0).any(axis=1).mean())


def evaluate(task: Any, score: Callable, completions: Callable, generate: Callable, clean_state, ids, valid,
             problems: list, key: jax.Array, k: int) -> dict:
  """Greedy accuracy (+ why greedy answers fail), sampled mean@k and pass@k on fixed prompts.

  `score(problems, rollout)` gives rewards and `completions(rollout)` the texts (the
  trainer's host-side helpers); `generate(state, ids, valid, key, kind)` is the run's
  generate program (`programs.StepPrograms.generate`: kind 'greedy' or 'sampled');
  `clean_state` are the float32 weights (no quant, no noise).
  """
  n = len(problems)
  ro = generate(clean_state, ids, valid, key, "greedy")
  texts = completions(ro)
  greedy = [task.reward(p, t) for p, t in zip(problems, texts)]
  out = {"eval_greedy_accuracy": float(np.mean(greedy))}
  if hasattr(task, "reward_details"):
    # Why greedy answers fail (malformed, wrong numbers, wrong value): what RL is fixing.
    outcomes = collections.Counter(task.reward_details(p, t).error or "correct"
                                   for p, t in zip(problems, texts))
    out.update({f"eval_greedy_outcome/{name}": c / n for name, c in sorted(outcomes.items())})
  ids, valid = rollout_lib.repeat_prompts((ids, valid), k)
  ro = generate(clean_state, ids, valid, key, "sampled")
  r_nk = score([p for p in problems for _ in range(k)], ro).reshape(n, k)
  out["eval_sampled_accuracy"] = float(r_nk.mean())
  out["eval_pass_at_k"] = pass_at_k(r_nk)
  return out
