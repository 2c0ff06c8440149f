"""One decode-and-record step, both engines': the typed per-row records and the step that writes them."""
from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from rl_jax.logprobs import next_token_logq
from rl_jax.rollout import expert_id_dtype
from rl_jax.sampler import decode as decode_lib
from rl_jax.sampler.config import SamplerConfig

TRUNC_FIELDS = ("trunc_thresh_BT", "trunc_logmass_BT", "trunc_size_BT")


class Records(NamedTuple):
  """What a decode records per row (B rows, T response steps, S = P + T slots, N rows or slots
  decoding together), written one step at a time by `decode_and_record`; None where the config
  records nothing. The engines keep their own state (steps, slots, the KV cache) beside it."""
  tokens_BS: jax.Array                   # prompt left-padded in [0, P), response token j at P + j
  active_BT: jax.Array                   # step j produced a real token
  logq_BT: jax.Array                     # its sampler log-prob (0 where none)
  head_mass_BT: jax.Array                # the recorded top-k's mass (top-1's when none is recorded)
  topk_ids_BTK: Optional[jax.Array]
  topk_logq_BTK: Optional[jax.Array]
  experts_BSLK: Optional[jax.Array]      # routed expert ids per slot fed (compact dtype)
  version_BT: Optional[jax.Array]        # the policy version that sampled step j (in-flight updates)
  trunc_thresh_BT: Optional[jax.Array]   # the kept set of top-k / top-p sampling
  trunc_logmass_BT: Optional[jax.Array]
  trunc_size_BT: Optional[jax.Array]
  # The previous step's distribution over its N rows, whose top-k is recorded one step late
  # (software pipelining: XLA runs the single-threaded top-k beside the next step's forward), with
  # the row it belongs to (B: none) and its step.
  pending_logq_NV: Optional[jax.Array]
  pending_row_N: Optional[jax.Array]
  pending_step_N: Optional[jax.Array]


def init_records(tokens_BP: jax.Array, n: int, vocab: int, cfg: SamplerConfig, *, experts_BSLK=None,
                 versions: bool = False) -> Records:
  """Empty records for the rows of `tokens_BP` (laid out, [B, P]) decoded `n` at a time;
  `experts_BSLK`: the prefill's routes already written (None: no expert is recorded)."""
  b, t, k = tokens_BP.shape[0], cfg.max_new_tokens, cfg.record_topk
  zeros = lambda dtype=jnp.float32: jnp.zeros((b, t), dtype)
  trunc = {name: zeros(jnp.int32 if name == "trunc_size_BT" else jnp.float32) if cfg.truncates else None
           for name in TRUNC_FIELDS}
  return Records(
      tokens_BS=jnp.concatenate([tokens_BP, jnp.full((b, t), cfg.pad_id, jnp.int32)], axis=1),
      active_BT=zeros(bool), logq_BT=zeros(), head_mass_BT=zeros(),
      topk_ids_BTK=jnp.zeros((b, t, k), jnp.int32) if k else None,
      topk_logq_BTK=jnp.zeros((b, t, k), jnp.float32) if k else None,
      experts_BSLK=experts_BSLK, version_BT=zeros(jnp.int32) if versions else None, **trunc,
      pending_logq_NV=jnp.zeros((n, vocab), jnp.float32) if k else None,
      pending_row_N=jnp.full((n,), b, jnp.int32) if k else None,
      pending_step_N=jnp.zeros((n,), jnp.int32) if k else None)


def _write_topk(rec: Records, logq_NV, row_N, step_N, k: int) -> Records:
  """The top-k of `logq_NV` recorded at (row, step) of each of its N rows (row B: dropped)."""
  top_logq_NK, top_ids_NK = decode_lib.recorded_top_k(logq_NV, k)
  at = (row_N, step_N)
  return rec._replace(
      topk_ids_BTK=rec.topk_ids_BTK.at[at].set(top_ids_NK.astype(jnp.int32), mode="drop"),
      topk_logq_BTK=rec.topk_logq_BTK.at[at].set(top_logq_NK, mode="drop"),
      head_mass_BT=rec.head_mass_BT.at[at].set(jnp.sum(jnp.exp(top_logq_NK), axis=-1), mode="drop"))


def flush(rec: Records, cfg: SamplerConfig) -> Records:
  """The records with the last step's pending top-k written: a finished decode's."""
  if not cfg.record_topk:
    return rec
  return _write_topk(rec, rec.pending_logq_NV, rec.pending_row_N, rec.pending_step_N, cfg.record_topk)


def decode_and_record(model, rec: Records, cache, tok_N1, pos_N1, *, cache_index, kv_valid_NC, keys_N, step_N,
                      row_N, cfg: SamplerConfig, version=None):
  """One token for each of N rows: the forward over `tok_N1` at `pos_N1` (writing the KV cache at
  `cache_index`, a slot or one per row), the sampler's distribution at `cfg.temperature`, a draw
  with row key `keys_N` folded with its step `step_N`, and every record of it written at (row
  `row_N`, step `step_N`): the token at slot P + step, its log q, the kept set, the top-k (one step
  late), the routes at the slot fed (P - 1 + step), the policy `version`. A row of `row_N` equal to
  B decodes nothing: its draw is the pad id and none of its records is written.

  Returns (records, cache, y_N): the drawn ids, for the engine's own bookkeeping (EOS, limits)."""
  b = rec.tokens_BS.shape[0]
  p, k = cfg.max_prompt_len, cfg.record_topk
  out = model(tok_N1, pos_N1, cache=cache, cache_index=cache_index, kv_valid_BC=kv_valid_NC)
  logq_NV = next_token_logq(out.logits_BSV[:, 0], cfg.temperature)
  y_N, trunc = decode_lib.sample(out.logits_BSV[:, 0], logq_NV, keys_N, step_N, cfg)
  dec_N = row_N < b
  y_N = jnp.where(dec_N, y_N, cfg.pad_id)
  logq_N = jnp.take_along_axis(logq_NV, y_N[:, None], axis=-1)[:, 0]
  at = (row_N, step_N)
  new = dict(tokens_BS=rec.tokens_BS.at[row_N, p + step_N].set(y_N, mode="drop"),
             active_BT=rec.active_BT.at[at].set(True, mode="drop"),
             logq_BT=rec.logq_BT.at[at].set(logq_N, mode="drop"),
             **{name: getattr(rec, name).at[at].set(v_N, mode="drop") for name, v_N in trunc.items()})
  if rec.version_BT is not None:
    new["version_BT"] = rec.version_BT.at[at].set(jnp.asarray(version, jnp.int32), mode="drop")
  if rec.experts_BSLK is not None:
    new["experts_BSLK"] = rec.experts_BSLK.at[row_N, p - 1 + step_N].set(
        out.expert_ids_BSLK[:, 0].astype(expert_id_dtype(model.cfg.n_experts)), mode="drop")
  rec = rec._replace(**new)
  if k:
    rec = _write_topk(rec, rec.pending_logq_NV, rec.pending_row_N, rec.pending_step_N, k)
    rec = rec._replace(pending_logq_NV=logq_NV, pending_row_N=row_N, pending_step_N=step_N)
  else:
    # record_topk = 0 still records the top-1 mass (one max over V, no sort): a floor on any head
    # mass, so the head-mass diagnostic exists in every config.
    rec = rec._replace(head_mass_BT=rec.head_mass_BT.at[at].set(jnp.exp(jnp.max(logq_NV, axis=-1)), mode="drop"))
  return rec, out.cache, y_N
