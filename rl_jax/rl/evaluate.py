"""Held-out evaluation of the RL policy: greedy accuracy and outcome breakdown, mean@k, pass@k."""
from __future__ import annotations

import collections
from typing import Any, Callable

import jax
import numpy as np

from rl_jax import rollout as rollout_lib
from rl_jax import sharding as sh
from rl_jax.rl import source_metrics
from rl_jax.rl.source_metrics import pass_at_k


def evaluate(task: Any, score: Callable, completions: Callable, generate: Callable, clean_state, ids, valid,
             problems: list, key: jax.Array, k: int, eos_id: int | None = None) -> dict:
  """Greedy accuracy (+ why greedy answers fail), sampled mean@k and pass@k on fixed prompts.

  `score(problems, rollout)` gives rewards and `completions(rollout)` the texts (the
  trainer's host-side helpers); `generate(state, ids, valid, key, kind)` is the run's
  generate program (`SamplerPrograms.generate`: kind 'greedy' or 'sampled');
  `clean_state` are the float32 weights (no quant, no noise). A task with `source_of` (the
  dataset task) also gets `eval/<source>/...` metrics (source_metrics.eval_metrics) given `eos_id`.
  """
  n = len(problems)
  ro = generate(clean_state, ids, valid, key, "greedy")
  texts = completions(ro)
  if hasattr(task, "score_batch"):  # one batched (sandboxed) verifier pass: rewards and errors
    details = task.score_batch(problems, texts)
    greedy = [d.reward for d in details]
  else:
    greedy = [task.reward(p, t) for p, t in zip(problems, texts)]
    details = ([task.reward_details(p, t) for p, t in zip(problems, texts)]
               if hasattr(task, "reward_details") else None)
  out = {"eval_greedy_accuracy": float(np.mean(greedy))}
  if details is not None:
    # Why greedy answers fail (malformed, wrong numbers, wrong value): what RL is fixing.
    outcomes = collections.Counter(d.error or "correct" for d in details)
    out.update({f"eval_greedy_outcome/{name}": c / n for name, c in sorted(outcomes.items())})
  ids, valid = rollout_lib.repeat_prompts((ids, valid), k)
  ro = generate(clean_state, ids, valid, key, "sampled")
  r_nk = score([p for p in problems for _ in range(k)], ro).reshape(n, k)
  keys = None
  if hasattr(task, "answer_keys"):   # maj@k: the answers the k samples state, voted per prompt
    texts_k = completions(ro)
    keys = [task.answer_keys(p, texts_k[i * k:(i + 1) * k]) for i, p in enumerate(problems)]
  out["eval_sampled_accuracy"] = float(r_nk.mean())
  out["eval_pass_at_k"] = pass_at_k(r_nk)
  if eos_id is not None and hasattr(task, "source_of"):
    response = sh.to_host(ro.response_BT)
    lengths = sh.to_host(ro.lengths_B)
    trunc = source_metrics.truncated(lengths, response[:, -1], response.shape[1], eos_id)
    out.update(source_metrics.eval_metrics([task.source_of(p) for p in problems], np.asarray(greedy), r_nk,
                                           np.asarray(lengths).reshape(n, k), trunc.reshape(n, k), keys))
  return out
