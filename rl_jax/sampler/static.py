"""The static engine: rows in waves, each wave prefilled together and decoded until its longest row ends."""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from rl_jax import microbatch
from rl_jax.models.kv_cache import cache_len, grow_cache, init_cache
from rl_jax.models.layers import dtype_of
from rl_jax.models.transformer import default_positions
from rl_jax.rollout import Rollout, expert_id_dtype
from rl_jax.sampler import decode_step
from rl_jax.sampler.config import SamplerConfig
from rl_jax.sampler.decode import assemble_rollout, left_pad, prefill


class Carry(NamedTuple):
  """The decode loop's state: its step j (every row's), which rows have ended, the KV cache, the records."""
  step: jax.Array
  done_B: jax.Array
  cache: list
  rec: decode_step.Records


def generate_rows(model, prompts_BP, valid_BP, keys_B, max_new_B, *, cfg: SamplerConfig, kv_spec, constrain,
                  div) -> Rollout:
  """The static engine over all B rows (`generate_program` with `cfg.engine='static'`): waves of
  `cfg.max_rows_in_flight` strided rows (`rl_jax.microbatch`: each wave spans every batch-axis device)
  in a `lax.scan`, each wave with its own KV cache; row b samples with `keys_B[b]` either way, so its
  tokens do not depend on the waves."""
  waves = microbatch.count(prompts_BP.shape[0], cfg.max_rows_in_flight, "sampler.max_rows_in_flight", div)
  rows = lambda x: wave(model, *x, cfg=cfg, kv_spec=kv_spec, constrain=constrain, div=div)
  if waves == 1:
    return rows((prompts_BP, valid_BP, keys_B, max_new_B))
  _, ro = jax.lax.scan(lambda c, x: (c, rows(x)), None,
                       microbatch.split((prompts_BP, valid_BP, keys_B, max_new_B), waves))
  return constrain(microbatch.merge(ro))


def wave(model, prompts_BP, valid_BP, keys_B, max_new_B, *, cfg: SamplerConfig, kv_spec, constrain, div) -> Rollout:
  """Prefill + decode of one wave of rows, row b sampling with `keys_B[b]`."""
  mcfg = model.cfg
  b = prompts_BP.shape[0]
  p, t, s = cfg.max_prompt_len, cfg.max_new_tokens, cfg.max_len
  record_experts = cfg.record_experts and mcfg.n_moe_layers > 0

  tokens_BP, pvalid_BP = constrain(left_pad(prompts_BP, valid_BP.astype(bool), p, cfg.pad_id))
  prompt_len_B = jnp.sum(pvalid_BP, axis=1, dtype=jnp.int32)
  positions_BP = default_positions(pvalid_BP)
  # Response token j sits at slot p + j with position prompt_len + j.
  positions_BS = jnp.concatenate([positions_BP, prompt_len_B[:, None] + jnp.arange(t, dtype=jnp.int32)], 1)
  # Keys of response slots are valid; the causal `slot <= query slot` rule hides the
  # future ones. Rows that finished keep decoding garbage that nobody reads.
  kv_valid_BC = jnp.concatenate([pvalid_BP, jnp.ones((b, t), bool)], axis=1)
  # The cache starts at the first decode phase's slots (the prefill's p-1 fit in them).
  slots0 = cfg.phase_bounds()[0][1]
  # Compact ids (uint8 up to 256 experts): 1/4 of int32's bytes in the carry and the rollout.
  experts_BSLK = (jnp.zeros((b, s, mcfg.n_moe_layers, mcfg.n_experts_per_tok), expert_id_dtype(mcfg.n_experts))
                  if record_experts else None)

  # Prefill: every prompt token but the last in one forward pass, no logits. The last
  # prompt token (slot p-1, real for every row thanks to left padding) is the first
  # decode step, so every logged distribution comes out of the same T=1 code path.
  if p > 1:
    cache, pre_experts = prefill(model, tokens_BP, positions_BP, pvalid_BP, kv_valid_BC, slots0, cfg=cfg,
                                 kv_spec=kv_spec, constrain=constrain, div=div)
    if record_experts:
      experts_BSLK = jax.lax.dynamic_update_slice(experts_BSLK, pre_experts, (0, 0, 0, 0))
  else:
    cache = constrain(init_cache(mcfg, b, slots0, dtype_of(mcfg.dtype), kv_spec,
                                 backend=getattr(cfg.quant, "backend", "auto")))
  rec = decode_step.init_records(tokens_BP, b, mcfg.vocab_size, cfg, experts_BSLK=experts_BSLK)
  rows_B = jnp.arange(b, dtype=jnp.int32)

  def body(c: Carry) -> Carry:
    j = c.step
    slot = p - 1 + j
    tok_B1 = jax.lax.dynamic_slice_in_dim(c.rec.tokens_BS, slot, 1, axis=1)
    pos_B1 = jax.lax.dynamic_slice_in_dim(positions_BS, slot, 1, axis=1)
    rec, cache, y_B = decode_step.decode_and_record(
        model, c.rec, c.cache, tok_B1, pos_B1, cache_index=slot, kv_valid_NC=kv_valid_BC[:, :cache_len(c.cache)],
        keys_N=keys_B, step_N=jnp.full((b,), j), row_N=jnp.where(c.done_B, b, rows_B), cfg=cfg)
    done_B = c.done_B | (y_B == cfg.eos_id) | (j + 1 >= max_new_B)
    return constrain(Carry(j + 1, done_B, cache, rec))

  # Decode phases: attention over the whole static cache at every step reads, on average,
  # twice the filled slots. Phase i's loop carries a cache of only the slots filled by its
  # last step (`SamplerConfig.phase_bounds`), grown between phases: a cache sliced inside
  # the loop instead makes XLA copy it whole at every step to keep the update in place.
  # A phase that finds every row done runs no step.
  c = constrain(Carry(jnp.zeros((), jnp.int32), jnp.zeros((b,), bool), cache, rec))
  for end, cache_slots in cfg.phase_bounds():
    c = constrain(c._replace(cache=grow_cache(c.cache, cache_slots)))
    c = jax.lax.while_loop(lambda c, end=end: (c.step < end) & ~jnp.all(c.done_B), body, c)
  return constrain(assemble_rollout(decode_step.flush(c.rec, cfg), pvalid_BP, prompt_len_B))
