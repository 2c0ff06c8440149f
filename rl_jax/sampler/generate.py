"""Jitted prefill + KV-cache decode that records logq, top-k logprobs and routed experts on device."""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from rl_jax import microbatch
from rl_jax.logprobs import next_token_logq
from rl_jax.models.kv_cache import LayerKV, cache_len, grow_cache, init_cache
from rl_jax.models.layers import dtype_of
from rl_jax.models.transformer import default_positions
# The contract (layout, alignment) lives in rl_jax.rollout.
from rl_jax.rollout import Rollout, expert_id_dtype
from rl_jax.sampler.config import SamplerConfig
from rl_jax.sharding import BATCH_AXES, batch_divisor, shard_batch

# ----------------------------------------------------------------------------------------
# Sampling.


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


def _truncate(logq_BV: jax.Array, top_k: int, top_p: float) -> tuple[jax.Array, jax.Array]:
  """Masks (-inf) tokens outside the top-k, then outside the top-p nucleus of what is left.

  Returns (masked log q, tau_B): the kept set is exactly {v : log q_v >= tau} (ties at the
  cut are kept), so tau is all the trainer needs to rebuild it by a threshold
  (`loss.sampling_mask='replay'`); -inf when nothing is cut. tau lies midway between the least
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


def _sample(logits_BV, logq_BV, keys_B, step, cfg: SamplerConfig) -> tuple[jax.Array, dict]:
  """The drawn ids and, when `cfg.truncates`, the kept set's record: its threshold tau, its log
  mass log q(K) and its size |K| (`Rollout.trunc_*`)."""
  if cfg.greedy:
    return first_argmax(logits_BV), {}
  x, tau_B = _truncate(logq_BV, cfg.top_k, cfg.top_p)
  # One key per row and step (`step` a scalar, or [B]: each row's own step, the continuous
  # engine): a row's sample depends on neither how the batch is split nor which slot ran it.
  step_keys = jax.vmap(jax.random.fold_in)(keys_B, jnp.broadcast_to(step, keys_B.shape[:1]))
  y_B = jax.vmap(categorical)(step_keys, x)
  if not cfg.truncates:
    return y_B, {}
  kept_BV = x > -jnp.inf
  return y_B, dict(trunc_thresh_BT=tau_B, trunc_logmass_BT=jax.nn.logsumexp(x, axis=-1),
                   trunc_size_BT=jnp.sum(kept_BV, axis=-1, dtype=jnp.int32))


# ----------------------------------------------------------------------------------------
# The generation program.


def _left_pad(prompts_BP, valid_BP, width: int, pad_id: int):
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


def _constrainer(mesh: Mesh | None, n_kv_heads: int):
  """Sharding constraints: batch dim over BATCH_AXES; KV-cache heads also over 'tensor'.

  The heads split matches the tensor-parallel split of wk / wv (`sharding.LOGICAL_RULES`),
  so each device attends over the heads it projected, without gathering the cache.
  """
  if mesh is None:
    return lambda tree: tree
  heads = "tensor" if n_kv_heads % mesh.shape["tensor"] == 0 else None

  def one(x, cache=False, stacked=False):
    if not hasattr(x, "ndim") or x.ndim == 0:
      return x
    lead = [None] if stacked else []  # a scanned layer group's leading layer axis
    rest = [None] * (x.ndim - 1 - len(lead))
    if cache:  # [B, H, S, D] values and [B, H, S, n] scales (heads-major, `LayerKV`)
      rest[0] = heads
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*lead, BATCH_AXES, *rest)))

  def constrain(tree):
    is_kv = lambda x: isinstance(x, LayerKV)
    kv = lambda x: jax.tree.map(functools.partial(one, cache=True, stacked=x.stacked), x)
    return jax.tree.map(lambda x: kv(x) if is_kv(x) else one(x), tree, is_leaf=is_kv)
  return constrain


def _record_topk(c, logq_BV, active_B, j, k: int) -> dict:
  """Top-k log q, ids and head mass of the distribution of step j, written at j (0 where inactive)."""
  top_logq_BK, top_ids_BK = exact_top_k(logq_BV, k)
  top_logq_BK = jnp.where(active_B[:, None], top_logq_BK, 0.0)
  top_ids_BK = jnp.where(active_B[:, None], top_ids_BK, 0).astype(jnp.int32)
  head_B = jnp.where(active_B, jnp.sum(jnp.exp(top_logq_BK), axis=-1), 0.0)
  return dict(
      topk_ids_BTK=jax.lax.dynamic_update_slice(c["topk_ids_BTK"], top_ids_BK[:, None], (0, j, 0)),
      topk_logq_BTK=jax.lax.dynamic_update_slice(c["topk_logq_BTK"], top_logq_BK[:, None], (0, j, 0)),
      head_mass_BT=jax.lax.dynamic_update_slice(c["head_mass_BT"], head_B[:, None], (0, j)))


_STATIC_ARGNAMES = ("graphdef", "cfg", "kv_spec", "mesh")


def generate_program(graphdef, state, prompts_BP, valid_BP, key, max_new_B=None, *, cfg: SamplerConfig, kv_spec,
                     mesh):
  """The traceable generation program (`_generate` is its jit; tests wrap it to count traces).

  With `cfg.max_rows_in_flight` the rows run in waves of strided rows (`rl_jax.microbatch`: each
  wave spans every batch-axis device) in a `lax.scan`, each wave with its own KV cache; row b
  samples with the b-th of `split(key, B)` either way, so its tokens do not depend on the waves.
  """
  model = nnx.merge(graphdef, state)
  mcfg = model.cfg
  cfg.check_vocab(mcfg.vocab_size)
  if mcfg.dtype != cfg.dtype:
    raise ValueError(f"the sampler graph computes in {mcfg.dtype} but sampler.dtype is {cfg.dtype}: build it "
                     "with weights.sampler_graphdef(model_cfg, cfg.dtype)")
  constrain = _constrainer(mesh, mcfg.n_kv_heads)
  b = prompts_BP.shape[0]
  keys_B = jax.random.split(key, b)
  # Each row's own response-length limit (at most max_new_tokens): a row ends at EOS or there.
  max_new_B = (jnp.full((b,), cfg.max_new_tokens, jnp.int32) if max_new_B is None
               else jnp.minimum(jnp.asarray(max_new_B, jnp.int32), cfg.max_new_tokens))
  div = batch_divisor(mesh) if mesh is not None else 1
  if cfg.engine == "continuous":  # slots bound the rows in flight: no waves
    from rl_jax.sampler import continuous  # pylint: disable=g-import-not-at-top
    return continuous.generate_rows(model, prompts_BP, valid_BP, keys_B, max_new_B, cfg=cfg, kv_spec=kv_spec,
                                    constrain=constrain, div=div)
  waves = microbatch.count(b, cfg.max_rows_in_flight, "sampler.max_rows_in_flight", div)
  rows = lambda x: _generate_rows(model, *x, cfg=cfg, kv_spec=kv_spec, constrain=constrain, div=div)
  if waves == 1:
    return rows((prompts_BP, valid_BP, keys_B, max_new_B))
  _, ro = jax.lax.scan(lambda c, x: (c, rows(x)), None,
                       microbatch.split((prompts_BP, valid_BP, keys_B, max_new_B), waves))
  return constrain(microbatch.merge(ro))


def _prefill(model, tokens_BP, positions_BP, pvalid_BP, kv_valid_BC, cache_slots: int, *, cfg, kv_spec,
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


def _generate_rows(model, prompts_BP, valid_BP, keys_B, max_new_B, *, cfg: SamplerConfig, kv_spec, constrain, div):
  """Prefill + decode of one wave of rows, row b sampling with `keys_B[b]` (`generate_program`)."""
  mcfg = model.cfg
  b = prompts_BP.shape[0]
  p, t, s = cfg.max_prompt_len, cfg.max_new_tokens, cfg.max_len
  n_moe, k_exp = mcfg.n_moe_layers, mcfg.n_experts_per_tok
  record_experts = cfg.record_experts and n_moe > 0
  k_rec = cfg.record_topk

  tokens_BP, pvalid_BP = constrain(_left_pad(prompts_BP, valid_BP.astype(bool), p, cfg.pad_id))
  prompt_len_B = jnp.sum(pvalid_BP, axis=1, dtype=jnp.int32)
  positions_BP = default_positions(pvalid_BP)
  tokens_BS = jnp.concatenate([tokens_BP, jnp.full((b, t), cfg.pad_id, jnp.int32)], axis=1)
  # Response token j sits at slot p + j with position prompt_len + j.
  positions_BS = jnp.concatenate([positions_BP, prompt_len_B[:, None] + jnp.arange(t, dtype=jnp.int32)], 1)
  # Keys of response slots are valid; the causal `slot <= query slot` rule hides the
  # future ones. Rows that finished keep decoding garbage that nobody reads.
  kv_valid_BC = jnp.concatenate([pvalid_BP, jnp.ones((b, t), bool)], axis=1)
  # The cache starts at the first decode phase's slots (the prefill's p-1 fit in them).
  slots0 = cfg.phase_bounds()[0][1]
  # Compact ids (uint8 up to 256 experts): 1/4 of int32's bytes in the carry and the rollout.
  experts_BSLK = (jnp.zeros((b, s, n_moe, k_exp), expert_id_dtype(mcfg.n_experts)) if record_experts
                  else None)

  # Prefill: every prompt token but the last in one forward pass, no logits. The last
  # prompt token (slot p-1, real for every row thanks to left padding) is the first
  # decode step, so every logged distribution comes out of the same T=1 code path.
  if p > 1:
    cache, pre_experts = _prefill(model, tokens_BP, positions_BP, pvalid_BP, kv_valid_BC, slots0, cfg=cfg,
                                  kv_spec=kv_spec, constrain=constrain, div=div)
    if record_experts:
      experts_BSLK = jax.lax.dynamic_update_slice(experts_BSLK, pre_experts, (0, 0, 0, 0))
  else:
    cache = constrain(init_cache(mcfg, b, slots0, dtype_of(mcfg.dtype), kv_spec,
                                 backend=getattr(cfg.quant, "backend", "auto")))

  carry = dict(
      step=jnp.zeros((), jnp.int32), cache=cache, tokens_BS=tokens_BS,
      done_B=jnp.zeros((b,), bool),
      active_BT=jnp.zeros((b, t), bool),
      logq_BT=jnp.zeros((b, t), jnp.float32),
      topk_ids_BTK=jnp.zeros((b, t, k_rec), jnp.int32) if k_rec else None,
      topk_logq_BTK=jnp.zeros((b, t, k_rec), jnp.float32) if k_rec else None,
      head_mass_BT=jnp.zeros((b, t), jnp.float32),
      experts_BSLK=experts_BSLK,
      # The step whose top-k is not recorded yet (k_rec > 0): its log q and active rows.
      pending_logq_BV=jnp.zeros((b, mcfg.vocab_size), jnp.float32) if k_rec else None,
      pending_active_B=jnp.zeros((b,), bool) if k_rec else None)
  trunc_keys = ("trunc_thresh_BT", "trunc_logmass_BT", "trunc_size_BT") if cfg.truncates else ()
  for name in trunc_keys:  # zero where inactive, like logq_BT
    carry[name] = jnp.zeros((b, t), jnp.int32 if name == "trunc_size_BT" else jnp.float32)
  carry = constrain(carry)

  def body(c):
    j = c["step"]
    slot = p - 1 + j
    tok_B1 = jax.lax.dynamic_slice_in_dim(c["tokens_BS"], slot, 1, axis=1)
    pos_B1 = jax.lax.dynamic_slice_in_dim(positions_BS, slot, 1, axis=1)
    out = model(tok_B1, pos_B1, cache=c["cache"], cache_index=slot,
                kv_valid_BC=kv_valid_BC[:, :cache_len(c["cache"])])
    logits_BV = out.logits_BSV[:, 0]
    logq_BV = next_token_logq(logits_BV, cfg.temperature)
    active_B = ~c["done_B"]
    y_B, trunc = _sample(logits_BV, logq_BV, keys_B, j, cfg)
    y_B = jnp.where(active_B, y_B, cfg.pad_id)
    logq_B = jnp.where(active_B, jnp.take_along_axis(logq_BV, y_B[:, None], axis=-1)[:, 0], 0.0)
    new = dict(c)
    new["step"] = j + 1
    new["cache"] = out.cache
    new["tokens_BS"] = jax.lax.dynamic_update_slice(c["tokens_BS"], y_B[:, None], (0, slot + 1))
    new["done_B"] = c["done_B"] | (y_B == cfg.eos_id) | (j + 1 >= max_new_B)
    new["active_BT"] = jax.lax.dynamic_update_slice(c["active_BT"], active_B[:, None], (0, j))
    new["logq_BT"] = jax.lax.dynamic_update_slice(c["logq_BT"], logq_B[:, None], (0, j))
    for name, v_B in trunc.items():
      v_B = jnp.where(active_B, v_B, jnp.zeros((), v_B.dtype))
      new[name] = jax.lax.dynamic_update_slice(c[name], v_B[:, None], (0, j))
    if k_rec:
      # Software pipelining: step j records the top-k of step j-1's distribution, which
      # depends on nothing this step computes, so XLA can run the (single-threaded) top-k
      # next to this step's forward; the last step's is recorded after the loop.
      new.update(_record_topk(c, c["pending_logq_BV"], c["pending_active_B"], jnp.maximum(j - 1, 0), k_rec))
      new["pending_logq_BV"], new["pending_active_B"] = logq_BV, active_B
    else:
      # record_topk = 0 still records the top-1 mass (one max over V, no sort): a floor on any
      # head mass, so the head-mass diagnostic exists in every config (MiniRL's included).
      head_B = jnp.where(active_B, jnp.exp(jnp.max(logq_BV, axis=-1)), 0.0)
      new["head_mass_BT"] = jax.lax.dynamic_update_slice(c["head_mass_BT"], head_B[:, None], (0, j))
    if record_experts:
      new["experts_BSLK"] = jax.lax.dynamic_update_slice(
          c["experts_BSLK"], out.expert_ids_BSLK.astype(c["experts_BSLK"].dtype), (0, slot, 0, 0))
    return constrain(new)

  # Decode phases: attention over the whole static cache at every step reads, on average,
  # twice the filled slots. Phase i's loop carries a cache of only the slots filled by its
  # last step (`SamplerConfig.phase_bounds`), grown between phases: a cache sliced inside
  # the loop instead makes XLA copy it whole at every step to keep the update in place.
  # A phase that finds every row done runs no step.
  c = carry
  for end, cache_slots in cfg.phase_bounds():
    c = constrain(dict(c, cache=grow_cache(c["cache"], cache_slots)))
    c = jax.lax.while_loop(lambda c, end=end: (c["step"] < end) & ~jnp.all(c["done_B"]), body, c)
  if k_rec:  # the last step's top-k (step >= 1: the loop runs at least once)
    c = {**c, **_record_topk(c, c["pending_logq_BV"], c["pending_active_B"], c["step"] - 1, k_rec)}

  return constrain(assemble_rollout(c, pvalid_BP, prompt_len_B, trunc_keys))


def assemble_rollout(c: dict, pvalid_BP, prompt_len_B, trunc_keys) -> Rollout:
  """The Rollout from a finished decode's per-row buffers (either engine's): masks, positions,
  the routes masked to the slots that carry one."""
  resp_BT = c["active_BT"]
  b, p = pvalid_BP.shape
  t = resp_BT.shape[1]
  zeros_BP = jnp.zeros((b, p), bool)
  response_mask_BS = jnp.concatenate([zeros_BP, resp_BT], axis=1)
  prompt_mask_BS = jnp.concatenate([pvalid_BP, jnp.zeros((b, t), bool)], axis=1)
  # Slot p-1+j was fed at step j, which produced a real token iff resp_BT[:, j]; the
  # last response slot is never fed. So a route exists exactly where resp_BT says.
  expert_valid_BS = jnp.concatenate([pvalid_BP[:, :p - 1], resp_BT, jnp.zeros((b, 1), bool)], axis=1)
  experts = c["experts_BSLK"]
  if experts is not None:
    experts = jnp.where(expert_valid_BS[:, :, None, None], experts, 0)
  return Rollout(
      tokens_BS=c["tokens_BS"],
      positions_BS=default_positions(prompt_mask_BS | response_mask_BS),
      prompt_mask_BS=prompt_mask_BS, response_mask_BS=response_mask_BS,
      logq_BT=c["logq_BT"], topk_ids_BTK=c["topk_ids_BTK"], topk_logq_BTK=c["topk_logq_BTK"],
      head_mass_BT=c["head_mass_BT"], expert_ids_BSLK=experts, expert_valid_BS=expert_valid_BS,
      lengths_B=jnp.sum(resp_BT, axis=1, dtype=jnp.int32), prompt_lengths_B=prompt_len_B,
      prompt_len=p, **{k: c[k] for k in trunc_keys})


_generate = jax.jit(generate_program, static_argnames=_STATIC_ARGNAMES)


def check_prompts(prompts_BP, prompt_valid_BP, cfg: SamplerConfig) -> None:
  """Host-side checks: shapes agree, no empty prompt, none longer than `max_prompt_len`.

  Prompts are never truncated: an over-long prompt is an error naming the row. Skipped
  for traced inputs (`generate` called inside another jit), which cannot be read.
  """
  if isinstance(prompt_valid_BP, jax.core.Tracer):
    return
  if isinstance(prompt_valid_BP, jax.Array) and not prompt_valid_BP.is_fully_addressable:
    return  # a multi-host batch cannot be read here: check each process's prompts before assembling it
  if np.ndim(prompts_BP) != 2 or np.shape(prompts_BP) != np.shape(prompt_valid_BP):
    raise ValueError(f"prompts {np.shape(prompts_BP)} and prompt_valid {np.shape(prompt_valid_BP)} must be "
                     "the same [B, P] shape")
  lengths = np.asarray(prompt_valid_BP).astype(bool).sum(axis=1)
  too_long = np.flatnonzero(lengths > cfg.max_prompt_len)
  if too_long.size:
    i = int(too_long[0])
    raise ValueError(f"prompt row {i} has {int(lengths[i])} tokens > sampler.max_prompt_len="
                     f"{cfg.max_prompt_len} ({too_long.size} row(s) too long); prompts are never "
                     "truncated: raise sampler.max_prompt_len or filter the prompts")
  empty = np.flatnonzero(lengths == 0)
  if empty.size:
    raise ValueError(f"prompt row {int(empty[0])} is empty: every prompt needs at least one token")


def _resolve_kv_spec(kv_spec, cfg: SamplerConfig):
  """The KV-cache format: `kv_spec` if given, else `cfg.quant.kv`; fp32 -> None.

  None makes `init_cache` store K/V in the sampler's compute dtype (what an fp32 or a
  bf16 engine does without KV quantization); 'bf16' forces a bf16 cache.
  """
  kv = getattr(cfg.quant, "kv", None) if kv_spec is None else kv_spec
  if kv is None or getattr(kv, "format", None) in (None, "fp32"):
    return None
  return kv


def generate(graphdef: nnx.GraphDef, sampler_state: Any, prompts_BP, prompt_valid_BP, key: jax.Array,
             cfg: SamplerConfig, kv_spec: Any = None, mesh: Mesh | None = None, max_new_B=None) -> Rollout:
  """Samples `max_new_tokens` continuations of a batch of prompts in one jitted program.

  Args:
    graphdef / sampler_state: the sampler model (`weights.sampler_graphdef`,
      `weights.sync_weights`).
    prompts_BP / prompt_valid_BP: int token ids and their mask, left-, right- or
      ragged-padded; re-laid out left-padded into `cfg.max_prompt_len` slots.
    key: PRNG key; the rollout is a deterministic function of it (row b samples step j
      with `fold_in(split(key, B)[b], j)`).
    cfg: sampling and recording settings (static: one compilation per cfg and shape).
    kv_spec: KV-cache format (a `quant.config.KVSpec`) overriding `cfg.quant.kv`; None
      (default) takes `cfg.quant.kv`, where fp32 means the sampler's compute dtype.
    mesh: if given, the batch is split over `rl_jax.sharding.BATCH_AXES`; B must be a
      multiple of `batch_divisor(mesh)`. The state keeps whatever sharding it has.
    max_new_B: optional int `[B]`, each row's own response-length limit (capped at
      `max_new_tokens`): a row ends at EOS or after that many tokens (the engine benchmark
      forces its length distribution with it).

  Returns a `Rollout` (see its docstring for the slot alignment).

  The program: re-layout, one batched prefill of slots [0, P-1) into a static KV cache
  (no logits), then `lax.while_loop`s whose step j feeds slot P-1+j (the last prompt
  token at j = 0) and samples token j into slot P+j; they stop at T steps or when
  every row has emitted EOS. There is one loop per decode phase (`cfg.decode_phases`),
  and phase i's cache holds only the slots its steps fill (about S = P + T in the last
  one). Feeding the last prompt token through the decode step means every logged
  distribution comes from one T=1 code path, and
  the prefill never materializes `[B, P, V]` logits. Call it from Python (it checks the
  prompts on the host); `_generate` is the jitted program for use inside other jits.
  """
  check_prompts(prompts_BP, prompt_valid_BP, cfg)
  kv_spec = _resolve_kv_spec(kv_spec, cfg)
  prompts_BP = jnp.asarray(prompts_BP, jnp.int32)
  prompt_valid_BP = jnp.asarray(prompt_valid_BP, bool)
  if mesh is not None:
    div = batch_divisor(mesh)
    if prompts_BP.shape[0] % div:
      raise ValueError(f"batch {prompts_BP.shape[0]} is not a multiple of the mesh's batch axes {div}")
    prompts_BP, prompt_valid_BP = shard_batch((prompts_BP, prompt_valid_BP), mesh)
    if max_new_B is not None:
      max_new_B = shard_batch(jnp.asarray(max_new_B, jnp.int32), mesh)
  return _generate(graphdef, sampler_state, prompts_BP, prompt_valid_BP, key, max_new_B, cfg=cfg, kv_spec=kv_spec,
                   mesh=mesh)
