"""Token batches for SFT (prompt + completion with a loss mask) and for sampling (left-padded prompts)."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from rl_jax.tasks import Problem, Task
from rl_jax.tasks.tokenizer import Tokenizer


def prompt_ids(task: Task, tok: Tokenizer, problem: Problem) -> list[int]:
  """bos + the prompt's tokens, or the task's own ids (a chat template renders its own specials)."""
  if hasattr(task, "prompt_ids"):
    return task.prompt_ids(problem, tok)
  return [tok.bos_id] + tok.encode(task.prompt(problem))


def sft_batch(task: Task, tok: Tokenizer, problems: Sequence[Problem], max_len: int) -> dict:
  """Right-padded `[B, max_len]` sequences aligned for next-token loss.

  Returns inputs_BT / targets_BT (targets = inputs shifted by one), valid_BT (real
  input tokens) and loss_mask_BT (targets that are completion tokens or eos).
  """
  b = len(problems)
  seq = np.full((b, max_len + 1), tok.pad_id, np.int32)
  is_target = np.zeros((b, max_len + 1), bool)
  valid = np.zeros((b, max_len + 1), bool)
  for i, p in enumerate(problems):
    prompt = prompt_ids(task, tok, p)
    completion = tok.encode(task.completion(p)) + [tok.eos_id]
    ids = prompt + completion
    if len(ids) > max_len + 1:
      raise ValueError(f"sft.max_len={max_len} too short for a sequence of {len(ids) - 1} "
                       f"tokens (problem {p})")
    seq[i, :len(ids)] = ids
    valid[i, :len(ids)] = True
    is_target[i, len(prompt):len(ids)] = True
  return dict(inputs_BT=seq[:, :-1], targets_BT=seq[:, 1:], valid_BT=valid[:, :-1],
              loss_mask_BT=is_target[:, 1:])


def prompt_batch(task: Task, tok: Tokenizer, problems: Sequence[Problem], max_prompt_len: int
                 ) -> tuple[np.ndarray, np.ndarray]:
  """Left-padded prompts `[B, max_prompt_len]` and their validity mask (error if too long)."""
  b = len(problems)
  ids_BP = np.full((b, max_prompt_len), tok.pad_id, np.int32)
  valid_BP = np.zeros((b, max_prompt_len), bool)
  for i, p in enumerate(problems):
    ids = prompt_ids(task, tok, p)
    if len(ids) > max_prompt_len:
      raise ValueError(f"prompt of {len(ids)} tokens exceeds max_prompt_len={max_prompt_len}: "
                       f"{task.prompt(p)!r}")
    ids_BP[i, max_prompt_len - len(ids):] = ids
    valid_BP[i, max_prompt_len - len(ids):] = True
  return ids_BP, valid_BP


def decode_completions(tok: Tokenizer, ids_BT: np.ndarray) -> list[str]:
  """Text of each generated row, stopping at eos (the tokenizer skips pad)."""
  return [tok.decode([int(t) for t in row]) for row in np.asarray(ids_BT)]
