"""Per-`data_source` metrics of a train step and of an evaluation, and verifier error shares (pure, host-side)."""
from __future__ import annotations

import collections
import re
from typing import Sequence

import numpy as np


def pass_at_k(rewards_NK: np.ndarray) -> float:
  """Fraction of prompts (rows) with at least one correct (reward >= 1) of their k samples."""
  return float((np.asarray(rewards_NK) >= 1.0).any(axis=1).mean())


def metric_name(source: str) -> str:
  """A source as one metric-path component, one to one: letters, digits, '_', '.', '-' are kept,
  every other character is '~' and its UTF-8 bytes in hex ('openai/gsm8k' -> 'openai~2fgsm8k').
  '~' is itself escaped, so 'a/b' and 'a_b' (or 'a~2fb') never share a name."""
  if not source:
    return "~"
  return re.sub(r"[^A-Za-z0-9_.\-]", lambda m: "".join(f"~{b:02x}" for b in m.group().encode()), source)


def majority_at_k(rewards_NK: np.ndarray, keys_NK: Sequence[Sequence[str | None] | None]) -> np.ndarray:
  """Per prompt: the reward of the answer most of its k samples state (ties: the one stated first;
  samples without an answer do not vote; no answer at all: 0; NaN for a row without keys, whose
  verifier's answers are not read as text)."""
  out = np.zeros(len(keys_NK))
  for i, keys in enumerate(keys_NK):
    if keys is None:
      out[i] = np.nan
      continue
    counts = collections.Counter(k for k in keys if k is not None)
    if counts:
      top = max(counts.values())
      winner = next(k for k in keys if k is not None and counts[k] == top)
      out[i] = float(np.asarray(rewards_NK)[i][list(keys).index(winner)])
  return out


def truncated(lengths_B: np.ndarray, last_token_B: np.ndarray, max_new_tokens: int, eos_id: int) -> np.ndarray:
  """Rows that hit max_new_tokens without ending in eos (a response ends with its eos or at T)."""
  lengths_B, last_token_B = np.asarray(lengths_B), np.asarray(last_token_B)
  return (lengths_B >= max_new_tokens) & (last_token_B != eos_id)


def error_shares(errors: Sequence[str], prefix: str = "verifier/") -> dict:
  """Share of completions per named verifier error ('' = correct is not listed)."""
  n = max(len(errors), 1)
  return {f"{prefix}{e}": c / n for e, c in sorted(collections.Counter(errors).items()) if e}


def train_metrics(sources: Sequence[str], rewards_R: np.ndarray, errors: Sequence[str],
                  lengths_R: np.ndarray, truncated_R: np.ndarray) -> dict:
  """A step's rows (R = prompts x group) split by source: reward, accuracy, length, truncation,
  and the batch's share of each source; plus the verifier's error shares over the whole batch."""
  rewards_R, lengths_R, truncated_R = (np.asarray(x) for x in (rewards_R, lengths_R, truncated_R))
  src = np.asarray(list(sources))
  out = {"truncated": float(truncated_R.mean()), **error_shares(errors)}
  for s in dict.fromkeys(sources):
    m = src == s
    name = f"train/{metric_name(s)}"
    out.update({f"{name}/reward": float(rewards_R[m].mean()),
                f"{name}/accuracy": float((rewards_R[m] >= 1.0).mean()),
                f"{name}/response_length": float(lengths_R[m].mean()),
                f"{name}/truncated": float(truncated_R[m].mean()),
                f"{name}/share": float(m.mean())})
  return out


def eval_metrics(sources: Sequence[str], greedy_N: np.ndarray, sampled_NK: np.ndarray,
                 lengths_NK: np.ndarray, truncated_NK: np.ndarray,
                 keys_NK: Sequence[Sequence[str | None] | None] | None = None) -> dict:
  """Per source: greedy accuracy, sampled avg@k (mean reward of k samples), pass@k, best@k (mean
  of the best reward of k), maj@k (`keys_NK`: per prompt the answers its samples state, or None where
  its verifier's answers are not read as text; the reward of the majority answer, for the sources
  with keys on every prompt), and the sampled responses' mean length and share truncated at
  max_new_tokens."""
  greedy_N, sampled_NK = np.asarray(greedy_N), np.asarray(sampled_NK)
  lengths_NK, truncated_NK = np.asarray(lengths_NK), np.asarray(truncated_NK)
  src = np.asarray(list(sources))
  out = {}
  majority = None if keys_NK is None else majority_at_k(sampled_NK, keys_NK)
  for s in dict.fromkeys(sources):
    m = src == s
    name = f"eval/{metric_name(s)}"
    if majority is not None and not np.isnan(majority[m]).any():
      out[f"{name}/maj_at_k"] = float(majority[m].mean())
    out.update({f"{name}/accuracy": float((greedy_N[m] >= 1.0).mean()),
                f"{name}/avg_at_k": float(sampled_NK[m].mean()),
                f"{name}/pass_at_k": pass_at_k(sampled_NK[m]),
                # The best of k samples' rewards, averaged over prompts: pass@k for {0, 1} rewards,
                # the graded counterpart for a user verifier's partial credit.
                f"{name}/best_at_k": float(sampled_NK[m].max(axis=1).mean()),
                f"{name}/response_length": float(lengths_NK[m].mean()),
                f"{name}/truncated": float(truncated_NK[m].mean()),
                f"{name}/count": float(m.sum())})
  return out
