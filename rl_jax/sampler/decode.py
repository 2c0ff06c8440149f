"""The sampler's row-level building blocks, shared by both engines: sampling (exact top-k, top-k / top-p truncation,
the two-stage categorical), left padding, the chunked prompt prefill and the Rollout assembly."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from rl_jax import microbatch
from rl_jax.models.kv_cache import cache_len, init_cache
from rl_jax.models.layers import dtype_of
from rl_jax.models.transformer import default_positions
from rl_jax.rollout import Rollout, expert_id_dtype
from rl_jax.ops import native_topk
from rl_jax.sampler.config import SamplerConfig


_TWO_STAGE_MIN_RATIO = 512


def exact_top_k(x_BV: jax.Array, k: int, min_ratio: int = _TWO_STAGE_MIN_RATIO
                ) -> tuple[jax.Array, jax.Array]:
  """`lax.top_k(x_BV, k)`, bit for bit (values, ids, tie order), with less sorting work.

  Two stages: split the vocabulary into chunks of c, keep the k chunks with the largest
  maxima, and take the top-k of their k*c elements. Exact: under the order (value
  desc, index asc) that `lax.top_k` uses, an element preceded by k chunk maxima is
  preceded by k elements, so every top-k element lies in a kept chunk; chunks are kept
  in vocabulary order so ties still break toward the lower id. With c ~ sqrt(V / 4k)
  the selection runs over V / c + k c elements instead of V (Qwen3's 152k vocabulary,
  k = 128: chunks of 16, 9.5k + 2k instead of 152k).
  """
  b, v = x_BV.shape
  # On CPU (jax 0.10) lax.top_k is faster up to V ~ 32k at k = 128, the two stages from
  # V ~ 64k on (x3 at 152k); below `min_ratio * k` the plain op is used.
  if v < min_ratio * k:
    return jax.lax.top_k(x_BV, k)
  chunk = 1
  while 4 * k * (2 * chunk) ** 2 <= v:  # largest power of two with c^2 <= V / (4k)
    chunk *= 2
  n_chunks = -(-v // chunk)
  pad = n_chunks * chunk - v
  if pad:  # -inf padding at the end loses every tie against a real element
    x_BV = jnp.concatenate([x_BV, jnp.full((b, pad), -jnp.inf, x_BV.dtype)], axis=1)
  x_BNC = x_BV.reshape(b, n_chunks, chunk)
  _, chunks_BK = jax.lax.top_k(jnp.max(x_BNC, axis=-1), k)
  chunks_BK = jnp.sort(chunks_BK, axis=-1)
  cand_BM = jnp.take_along_axis(x_BNC, chunks_BK[:, :, None], axis=1).reshape(b, k * chunk)
  ids_BM = (chunks_BK[:, :, None] * chunk + jnp.arange(chunk, dtype=chunks_BK.dtype)).reshape(b, k * chunk)
  vals_BK, pos_BK = jax.lax.top_k(cand_BM, k)
  return vals_BK, jnp.take_along_axis(ids_BM, pos_BK, axis=-1)


def recorded_top_k(logq_BV: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """The recorded top-k of a step (both engines call this): `lax.top_k`'s values and ids bit for bit.

  On CPU, float32: `native_topk.top_k` (an FFI handler: ~0.2 ms at [32, 4096], k = 128, where
  XLA:CPU's top-k custom call takes ~1.4 ms; recording top-k 128 + expert ids then costs +1% to
  +7% of the peer benchmark's decode, every row's 95% interval below 10%, against 17-27% with the
  custom call: docs/performance.md, `bench_recording.py`). Elsewhere, or where it cannot be built:
  `exact_top_k` (on CPU below the two-stage range, that custom call). `topk.threshold_top_k` gives
  the same bits from vectorized passes; inside the decode loop it cut the overhead on the dense
  model only.
  """
  if native_topk.usable_for(logq_BV):
    return native_topk.top_k(logq_BV, k)
  return exact_top_k(logq_BV, k)


def truncate(logq_BV: jax.Array, top_k: int, top_p: float) -> tuple[jax.Array, jax.Array]:
  """Masks (-inf) tokens outside the top-k, then outside the top-p nucleus of what is left.

  Returns (masked log q, tau_B): the kept set is exactly {v : log q_v >= tau} (ties at the
  cut are kept), so tau is all the trainer needs to rebuild it by a threshold
  (`loss.sampling_mask='kept_set'`); -inf when nothing is cut. tau lies midway between the least
  likely kept and the most likely cut log q, not at the kept one: the trainer's own log p of
  that boundary token differs from the sampler's by rounding, and at tau it would fall out
  about half the time.
  """
  x = logq_BV
  tau_B1 = jnp.full(x.shape[:-1] + (1,), -jnp.inf, x.dtype)
  if top_k:
    tau_B1 = exact_top_k(x, top_k)[0][:, -1:]
    x = jnp.where(x >= tau_B1, x, -jnp.inf)
  if top_p < 1.0:
    sorted_BV = -jnp.sort(-x, axis=-1)
    probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
    # A token is kept if the mass strictly before it is < top_p: the most likely token
    # is always kept, and the kept set is the smallest prefix reaching top_p.
    keep_BV = (jnp.cumsum(probs_BV, axis=-1) - probs_BV) < top_p
    n_keep_B1 = jnp.sum(keep_BV, axis=-1, keepdims=True)
    tau_B1 = jnp.take_along_axis(sorted_BV, n_keep_B1 - 1, axis=-1)  # >= the top-k cut
    x = jnp.where(x >= tau_B1, x, -jnp.inf)
  cut_B = jnp.max(jnp.where(x > -jnp.inf, -jnp.inf, logq_BV), axis=-1)  # the most likely cut token
  tau_B = jnp.where(cut_B > -jnp.inf, 0.5 * (tau_B1[:, 0] + cut_B), -jnp.inf)
  return x, tau_B


def first_argmax(x_BV: jax.Array) -> jax.Array:
  """`jnp.argmax(x_BV, -1)` (lowest index among equal maxima) as two plain reductions.

  XLA:CPU runs argmax as one variadic (value, index) reduction, about 10x slower than a
  max followed by a min over the matching indices. A row with NaN (no element equals
  its max) gets the last id rather than the NaN's.
  """
  v = x_BV.shape[-1]
  m_B1 = jnp.max(x_BV, axis=-1, keepdims=True)
  ids_BV = jnp.where(x_BV == m_B1, jnp.arange(v, dtype=jnp.int32), v - 1)
  return jnp.min(ids_BV, axis=-1)


def _chunk_size(v: int) -> int:
  """Power of two near sqrt(v): both stages of `categorical` draw about sqrt(v) Gumbels."""
  c = 1
  while (2 * c) ** 2 <= v:
    c *= 2
  return c


def categorical(key: jax.Array, logits_V: jax.Array) -> jax.Array:
  """One draw from softmax(logits_V) in two stages: a chunk by its mass, then a token in it.

  The vocabulary is cut into chunks of c ~ sqrt(V) ids; the chunk is drawn from the
  softmax of the chunks' logsumexps, then the token from the softmax within the chunk,
  so P(token) = (chunk mass / total) * (p_token / chunk mass), the same distribution
  as `jax.random.categorical` (a -inf logit is never drawn) with 2 sqrt(V) Gumbel
  draws instead of V: the V-wide random stream was the main per-step sampling cost.
  """
  v = logits_V.shape[-1]
  c = _chunk_size(v)
  n = -(-v // c)
  x = logits_V
  if n * c != v:  # -inf padding: never drawn
    x = jnp.concatenate([x, jnp.full((n * c - v,), -jnp.inf, x.dtype)])
  x_NC = x.reshape(n, c)
  k_chunk, k_tok = jax.random.split(key)
  j = jax.random.categorical(k_chunk, jax.nn.logsumexp(x_NC, axis=-1))
  i = jax.random.categorical(k_tok, x_NC[j])
  return (j * c + i).astype(jnp.int32)


def sample(logits_BV, logq_BV, keys_B, step, cfg: SamplerConfig) -> tuple[jax.Array, dict]:
  """The drawn ids and, when `cfg.truncates`, the kept set's record: its threshold tau, its log
  mass log q(K) and its size |K| (`Rollout.trunc_*`)."""
  if cfg.greedy:
    return first_argmax(logits_BV), {}
  x, tau_B = truncate(logq_BV, cfg.top_k, cfg.top_p)
  # One key per row and step (`step` a scalar, or [B]: each row's own step, the continuous
  # engine): a row's sample depends on neither how the batch is split nor which slot ran it.
  step_keys = jax.vmap(jax.random.fold_in)(keys_B, jnp.broadcast_to(step, keys_B.shape[:1]))
  y_B = jax.vmap(categorical)(step_keys, x)
  if not cfg.truncates:
    return y_B, {}
  kept_BV = x > -jnp.inf
  return y_B, dict(trunc_thresh_BT=tau_B, trunc_logmass_BT=jax.nn.logsumexp(x, axis=-1),
                   trunc_size_BT=jnp.sum(kept_BV, axis=-1, dtype=jnp.int32))


def left_pad(prompts_BP, valid_BP, width: int, pad_id: int):
  """Re-lays out any padding (left, right, ragged) as left padding in a `width` buffer."""
  b, p = prompts_BP.shape
  # Stable sort on the mask moves padding first and keeps the tokens' order.
  order_BP = jnp.argsort(valid_BP.astype(jnp.int32), axis=1, stable=True)
  toks = jnp.take_along_axis(prompts_BP, order_BP, axis=1)
  valid = jnp.take_along_axis(valid_BP, order_BP, axis=1)
  if p >= width:  # every row has <= width real tokens (checked on the host)
    toks, valid = toks[:, p - width:], valid[:, p - width:]
  else:
    toks = jnp.concatenate([jnp.full((b, width - p), pad_id, toks.dtype), toks], axis=1)
    valid = jnp.concatenate([jnp.zeros((b, width - p), bool), valid], axis=1)
  return jnp.where(valid, toks, pad_id).astype(jnp.int32), valid


def prefill(model, tokens_BP, positions_BP, pvalid_BP, kv_valid_BC, cache_slots: int, *, cfg, kv_spec,
             constrain, div):
  """The prompt prefill (no logits) into a fresh cache of `cache_slots` slots, `cfg.prefill_rows`
  rows at a time (strided chunks in a `lax.scan`); returns (cache, prefill experts or None)."""
  mcfg = model.cfg
  p = cfg.max_prompt_len

  def one(tok_bP, pos_bP, pv_bP, kvv_bC):
    cache = constrain(init_cache(mcfg, tok_bP.shape[0], cache_slots, dtype_of(mcfg.dtype), kv_spec,
                                 backend=getattr(cfg.quant, "backend", "auto")))
    out = model(tok_bP[:, :p - 1], pos_bP[:, :p - 1], pv_bP[:, :p - 1], cache=cache, cache_index=0,
                kv_valid_BC=kvv_bC[:, :cache_len(cache)], compute_logits=False)
    return constrain(out.cache), out.expert_ids_BSLK.astype(expert_id_dtype(mcfg.n_experts))

  xs = (tokens_BP, positions_BP, pvalid_BP, kv_valid_BC)
  chunks = microbatch.count(tokens_BP.shape[0], cfg.prefill_rows, "sampler.prefill_rows", div)
  if chunks == 1:
    return one(*xs)
  _, (caches, experts) = jax.lax.scan(lambda c, x: (c, one(*x)), None, microbatch.split(xs, chunks))
  # A layer-stacked cache (scanned layers) has its rows on axis 1.
  merge_kv = lambda kv: jax.tree.map(lambda x: microbatch.merge_axis(x, 1 if kv.stacked else 0), kv)
  return [merge_kv(kv) for kv in caches], microbatch.merge(experts)


def assemble_rollout(rec, pvalid_BP, prompt_len_B) -> Rollout:
  """The Rollout from a finished decode's records (`decode_step.Records`, either engine's, flushed):
  masks, positions, the routes masked to the slots that carry one."""
  resp_BT = rec.active_BT
  b, p = pvalid_BP.shape
  t = resp_BT.shape[1]
  zeros_BP = jnp.zeros((b, p), bool)
  response_mask_BS = jnp.concatenate([zeros_BP, resp_BT], axis=1)
  prompt_mask_BS = jnp.concatenate([pvalid_BP, jnp.zeros((b, t), bool)], axis=1)
  # Slot p-1+j was fed at step j, which produced a real token iff resp_BT[:, j]; the
  # last response slot is never fed. So a route exists exactly where resp_BT says.
  expert_valid_BS = jnp.concatenate([pvalid_BP[:, :p - 1], resp_BT, jnp.zeros((b, 1), bool)], axis=1)
  experts = rec.experts_BSLK
  if experts is not None:
    experts = jnp.where(expert_valid_BS[:, :, None, None], experts, 0)
  return Rollout(
      tokens_BS=rec.tokens_BS,
      positions_BS=default_positions(prompt_mask_BS | response_mask_BS),
      prompt_mask_BS=prompt_mask_BS, response_mask_BS=response_mask_BS,
      logq_BT=rec.logq_BT, topk_ids_BTK=rec.topk_ids_BTK, topk_logq_BTK=rec.topk_logq_BTK,
      head_mass_BT=rec.head_mass_BT, expert_ids_BSLK=experts, expert_valid_BS=expert_valid_BS,
      lengths_B=jnp.sum(resp_BT, axis=1, dtype=jnp.int32), prompt_lengths_B=prompt_len_B,
      prompt_len=p, trunc_thresh_BT=rec.trunc_thresh_BT, trunc_logmass_BT=rec.trunc_logmass_BT,
      trunc_size_BT=rec.trunc_size_BT, version_BT=rec.version_BT)
