"""Reference greedy decoding by full recompute (no KV cache): slow, simple, the ground truth."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rl_jax.sharding import to_host


@functools.partial(jax.jit, static_argnums=(0,))
def _next_token(graphdef, state, buf_BS, valid_BS, pos):
  model = nnx.merge(graphdef, state)
  logits = model(buf_BS, valid_BS=valid_BS).logits_BSV
  return jnp.argmax(logits[:, pos - 1], axis=-1).astype(jnp.int32)


def greedy_reference(model, prompts_BP: np.ndarray, prompt_valid_BP: np.ndarray, max_new_tokens: int,
                     eos_id: int, pad_id: int = 0) -> np.ndarray:
  """Greedy continuation `[B, max_new_tokens]` (pad after EOS) of left-padded prompts.

  Recomputes the whole sequence each step: O(T^2) but free of cache bookkeeping,
  which is what makes it a reference for the jitted sampler and for HF parity.
  """
  prompts_BP = np.asarray(prompts_BP, np.int32)
  b, p = prompts_BP.shape
  s = p + max_new_tokens
  buf = np.full((b, s), pad_id, np.int32)
  valid = np.zeros((b, s), bool)
  buf[:, :p] = prompts_BP
  valid[:, :p] = np.asarray(prompt_valid_BP, bool)
  done = np.zeros(b, bool)
  out = np.full((b, max_new_tokens), pad_id, np.int32)
  graphdef, state = nnx.split(model)
  for i in range(max_new_tokens):
    # Keys beyond the current step are masked as invalid, so the fixed-size buffer
    # gives one compilation for the whole loop.
    # to_host: with params sharded over several processes no one process holds the whole output.
    nxt = to_host(_next_token(graphdef, state, jnp.asarray(buf), jnp.asarray(valid), p + i))
    nxt = np.where(done, pad_id, nxt)
    out[:, i] = nxt
    buf[:, p + i] = nxt
    valid[:, p + i] = ~done
    done |= nxt == eos_id
    if done.all():
      break
  return out
