"""The continuous-batching engine: a fixed set of slots decodes together, a finished row's slot takes the next prompt."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from rl_jax.models.kv_cache import cache_prefix, init_cache, put_cache_prefix
from rl_jax.models.layers import dtype_of
from rl_jax.models.transformer import default_positions
from rl_jax.rollout import expert_id_dtype
from rl_jax.sampler import decode as decode_lib
from rl_jax.sampler import decode_step
from rl_jax.sampler.config import SamplerConfig

# The program (one `lax.while_loop`, everything on device; docs/architecture.md#the-sampler-engines):
#   - N slots, each with its own KV-cache region of S = P + T slots laid out as the static engine
#     lays out a row (prompt left-padded in [0, P), response token j at P + j), so a row's
#     arithmetic is the static engine's whatever slot runs it;
#   - the queue is the batch's rows in order; the first N are prefilled together (the static
#     engine's prefill), the others when a slot frees up;
#   - each iteration: (1) free slots take the next rows of the queue, (2) in each batch-axis
#     device's group of slots, the first that still has prompt to prefill prefills
#     `prefill_chunk` prompt slots of it (so a long prompt costs the other slots one chunk per
#     decode step, not a stall; per device, so no slot's cache leaves its device), (3) every slot
#     whose prompt is in the cache decodes one token at its own step j, written at its own cache
#     slot P - 1 + j;
#   - row b samples step j with fold_in(split(key, B)[b], j), as in the static engine, and every
#     record (log q, top-k, kept set, routes) is scattered to row b's own index of the rollout.


def _groups(x, ax: int, div: int):
  """x with its slot axis `ax` viewed as [div, N / div]: group g is the slots of batch-axis device g
  (the slot axis is split over the mesh's batch axes in contiguous blocks of N / div)."""
  return x.reshape(x.shape[:ax] + (div, x.shape[ax] // div) + x.shape[ax + 1:])


def _group_slot_cache(cache, i_G, div: int):
  """Slot `i_G[g]` of each group g of every layer's cache: a cache of `div` rows (rows on axis 1 of a
  layer-stacked cache). Each group slices its own device's slots: nothing is gathered."""
  def one(x, ax):
    take = lambda x_M, i: jax.lax.dynamic_index_in_dim(x_M, i, axis=ax, keepdims=False)
    return jax.vmap(take, in_axes=(ax, 0), out_axes=ax)(_groups(x, ax, div), i_G)
  return [jax.tree.map(lambda x, ax=int(kv.stacked): one(x, ax), kv) for kv in cache]


def _put_group_slot_cache(cache, part, i_G, div: int):
  """`cache` with group g's slot `i_G[g]` set to row g of `part` (`_group_slot_cache`'s layout)."""
  def one(x, y, ax):
    put = lambda x_M, y_, i: jax.lax.dynamic_update_index_in_dim(x_M, y_, i, axis=ax)
    return jax.vmap(put, in_axes=(ax, ax, 0), out_axes=ax)(_groups(x, ax, div), y, i_G).reshape(x.shape)
  return [jax.tree.map(lambda x, y, ax=int(kv.stacked): one(x, y, ax), kv, kp) for kv, kp in zip(cache, part)]


def _first_pending(pending_N, div: int):
  """Per slot group (`_groups`), whether a slot is pending, the first pending one's index in its group
  and in the slot axis: (has_G, i_G, slot_G)."""
  pending_GM = pending_N.reshape(div, pending_N.shape[0] // div)
  has_G = jnp.any(pending_GM, axis=1)
  i_G = jnp.argmax(pending_GM, axis=1).astype(jnp.int32)  # the group's own slot index
  return has_G, i_G, jnp.arange(div, dtype=jnp.int32) * pending_GM.shape[1] + i_G


def _group_chunk(model, cache, tokens_GC, positions_GC, valid_GC, start_G, kv_valid_GS, has_G, i_G, div: int):
  """The chunked prefill's forward: C slots of one slot per group (`i_G`), the tokens at cache slots
  [start_G, start_G + C) of that slot's row, written into its cache region (no logits). A group
  without a pending slot (`has_G` False) writes its slot's cache back unchanged. Returns (cache, the
  model's output)."""
  part = _group_slot_cache(cache, i_G, div)
  out = model(tokens_GC, positions_GC, valid_GC, cache=part, cache_index=start_G, kv_valid_BC=kv_valid_GS,
              compute_logits=False)
  kept = [jax.tree.map(lambda x, y, ax=int(kv.stacked): jnp.where(
      has_G.reshape((1,) * ax + (div,) + (1,) * (x.ndim - ax - 1)), y, x), kv, kn)
          for kv, kn in zip(part, out.cache)]
  return _put_group_slot_cache(cache, kept, i_G, div), out


def generate_rows(model, prompts_BP, valid_BP, keys_B, max_new_B, *, cfg: SamplerConfig, kv_spec, constrain, div):
  """The continuous engine over all B rows (`generate_program` with `cfg.engine='continuous'`): `init`,
  `run` to the end, `finish`, in one program."""
  carry = init(model, prompts_BP, valid_BP, keys_B, max_new_B, cfg=cfg, kv_spec=kv_spec, constrain=constrain,
               div=div)
  return finish(run(model, carry, cfg=cfg, constrain=constrain, div=div), cfg=cfg, constrain=constrain)


def init(model, prompts_BP, valid_BP, keys_B, max_new_B, *, cfg: SamplerConfig, kv_spec, constrain, div,
         versions: bool = False, prefill: bool = True) -> dict:
  """The engine's carry before its first iteration: the first N rows prefilled into the slots.

  Everything the loop reads is in it (the laid-out prompts, each row's key and length limit), so
  `run` can continue it in another program, with other weights (`rl_jax/sampler/chunked.py`).
  `versions`: record each token's policy version (`version_BT`, the `version` argument of `run`).
  `prefill=False`: the cache left empty (zeros), for `resume` to fill.
  """
  mcfg = model.cfg
  b = prompts_BP.shape[0]
  p, t, s = cfg.max_prompt_len, cfg.max_new_tokens, cfg.max_len
  n = cfg.slots_for(b, div)
  n_moe, k_exp = mcfg.n_moe_layers, mcfg.n_experts_per_tok
  record_experts = cfg.record_experts and n_moe > 0
  backend = getattr(cfg.quant, "backend", "auto")

  tokens_BP, pvalid_BP = constrain(decode_lib.left_pad(prompts_BP, valid_BP.astype(bool), p, cfg.pad_id))
  prompt_len_B = jnp.sum(pvalid_BP, axis=1, dtype=jnp.int32)
  positions_BP = default_positions(pvalid_BP)
  positions_BS = jnp.concatenate([positions_BP, prompt_len_B[:, None] + jnp.arange(t, dtype=jnp.int32)], 1)
  kv_valid_BS = jnp.concatenate([pvalid_BP, jnp.ones((b, t), bool)], axis=1)
  exp_dtype = expert_id_dtype(mcfg.n_experts)
  experts_BSLK = jnp.zeros((b, s, n_moe, k_exp), exp_dtype) if record_experts else None

  # The first N rows of the queue: one batched prefill, as the static engine's.
  if p > 1 and prefill:
    cache, pre_experts = decode_lib.prefill(
        model, tokens_BP[:n], positions_BP[:n], pvalid_BP[:n], kv_valid_BS[:n], s, cfg=cfg, kv_spec=kv_spec,
        constrain=constrain, div=div)
    if record_experts:
      experts_BSLK = jax.lax.dynamic_update_slice(experts_BSLK, pre_experts, (0, 0, 0, 0))
  else:
    cache = constrain(init_cache(mcfg, n, s, dtype_of(mcfg.dtype), kv_spec, backend=backend))

  rec = decode_step.init_records(tokens_BP, n, mcfg.vocab_size, cfg, experts_BSLK=experts_BSLK, versions=versions)
  carry = dict(
      # The rows' fixed inputs: prompts laid out, positions, key masks, keys, length limits.
      tokens_BP=tokens_BP, pvalid_BP=pvalid_BP, prompt_len_B=prompt_len_B, positions_BP=positions_BP,
      positions_BS=positions_BS, kv_valid_BS=kv_valid_BS, keys_B=keys_B, max_new_B=max_new_B,
      cache=cache,
      # Slot state: its row (b = none), the row's decode step, whether the row is unfinished,
      # whether its prompt is all in the cache, and the start of its next prefill chunk.
      row_N=jnp.arange(n, dtype=jnp.int32), step_N=jnp.zeros((n,), jnp.int32),
      live_N=jnp.ones((n,), bool), ready_N=jnp.ones((n,), bool), chunk_N=jnp.zeros((n,), jnp.int32),
      next_row=jnp.asarray(n, jnp.int32))
  return constrain(with_records(carry, rec))


def records(c: dict) -> decode_step.Records:
  """The carry's records (`decode_step.Records`: its per-row buffers, kept in the carry under their
  own names, so a checkpointed carry is a flat dict)."""
  return decode_step.Records(**{f: c.get(f) for f in decode_step.Records._fields})


def with_records(c: dict, rec: decode_step.Records) -> dict:
  """`c` with `rec` written back; the kept-set fields only where the config records them."""
  return {**c, **{k: v for k, v in rec._asdict().items() if v is not None or k not in decode_step.TRUNC_FIELDS}}


def unfinished(c: dict) -> jax.Array:
  """Whether the carry has rows left: one decoding, or one still in the queue."""
  return jnp.any(c["live_N"]) | (c["next_row"] < c["tokens_BS"].shape[0])


def run(model, carry: dict, *, cfg: SamplerConfig, constrain, div: int, version=None, n_iters=None) -> dict:
  """The engine's iterations from `carry` until every row has ended, or at most `n_iters` of them
  (a traced int; None = no limit); `div`: the mesh's batch-axis devices, as `init`'s. Each token is sampled by `model`'s weights; with a `version_BT`
  in the carry, `version` (a traced int) is recorded for it. Stopping after any iteration and
  going on in another call runs the same iterations in the same order as one call."""
  mcfg = model.cfg
  b = carry["tokens_BS"].shape[0]
  p, s = cfg.max_prompt_len, cfg.max_len
  n_moe = mcfg.n_moe_layers
  record_experts = cfg.record_experts and n_moe > 0
  exp_dtype = expert_id_dtype(mcfg.n_experts)
  ch = min(cfg.prefill_chunk, p - 1)  # prompt slots per refill chunk (0: nothing to prefill)
  n = carry["row_N"].shape[0]

  def refill(c):
    """Free slots take the next rows of the queue, in slot order."""
    free_N = ~c["live_N"]
    new_row_N = c["next_row"] + jnp.cumsum(free_N.astype(jnp.int32)) - 1
    take_N = free_N & (new_row_N < b)
    first_N = p - c["prompt_len_B"][jnp.minimum(new_row_N, b - 1)]  # the new row's first real prompt slot
    return dict(c, row_N=jnp.where(take_N, new_row_N, c["row_N"]),
                step_N=jnp.where(take_N, 0, c["step_N"]), live_N=c["live_N"] | take_N,
                ready_N=jnp.where(take_N, ch == 0, c["ready_N"]),
                chunk_N=jnp.where(take_N, jnp.minimum(first_N, p - 1 - ch), c["chunk_N"]),
                next_row=c["next_row"] + jnp.sum(take_N, dtype=jnp.int32))

  def prefill_chunk(c, l):
    """Prompt slots [start, start + ch) of each slot group's first slot still prefilling, into its
    cache region: one row per group (`_groups`: a group is one batch-axis device's slots), so each
    device prefills one of its own slots and no slot's cache leaves its device. A group with no slot
    prefilling computes a row nobody keeps. The last chunk starts at P - 1 - ch (it may redo a few
    slots of the one before: same tokens)."""
    has_G, i_G, slot_G = _first_pending(c["live_N"] & ~c["ready_N"], div)
    r_G, start_G = jnp.minimum(c["row_N"][slot_G], b - 1), c["chunk_N"][slot_G]
    rows = lambda x: jax.vmap(lambda r, st: jax.lax.dynamic_slice(x, (r, st), (1, ch))[0])(r_G, start_G)
    cache, out = _group_chunk(model, c["cache"], rows(c["tokens_BP"]), rows(c["positions_BP"]), rows(c["pvalid_BP"]),
                              start_G, c["kv_valid_BS"][r_G, :l], has_G, i_G, div)
    new = dict(c, cache=cache)
    w_G = jnp.where(has_G, r_G, b)  # row b: out of bounds, dropped
    if record_experts:
      cols_C = jnp.arange(ch, dtype=jnp.int32)
      new["experts_BSLK"] = c["experts_BSLK"].at[w_G[:, None], start_G[:, None] + cols_C].set(
          out.expert_ids_BSLK.astype(exp_dtype), mode="drop")
    at_G = jnp.where(has_G, slot_G, n)  # slot n: dropped
    new["ready_N"] = c["ready_N"].at[at_G].set(start_G + ch >= p - 1, mode="drop")
    new["chunk_N"] = c["chunk_N"].at[at_G].set(jnp.minimum(start_G + ch, p - 1 - ch), mode="drop")
    return new

  def decode(c, l):
    """One token for every slot whose prompt is in the cache, each at its own step; the cache holds
    the phase's first `l` slots."""
    dec_N = c["live_N"] & c["ready_N"]
    r_N = jnp.minimum(c["row_N"], b - 1)
    j_N = c["step_N"]
    slot_N = p - 1 + j_N
    # A slot that does not decode writes at the phase's last cache slot: at or past its own row's
    # frontier (>= P - 1), so its row writes that slot before any query of it reads it.
    rec, cache, y_N = decode_step.decode_and_record(
        model, records(c), c["cache"], c["tokens_BS"][r_N, slot_N][:, None], c["positions_BS"][r_N, slot_N][:, None],
        cache_index=jnp.where(dec_N, slot_N, l - 1), kv_valid_NC=c["kv_valid_BS"][r_N, :l], keys_N=c["keys_B"][r_N],
        step_N=j_N, row_N=jnp.where(dec_N, c["row_N"], b), cfg=cfg, version=version)
    new = with_records(dict(c, cache=cache), rec)
    ended_N = dec_N & ((y_N == cfg.eos_id) | (j_N + 1 >= c["max_new_B"][r_N]))
    new["step_N"] = jnp.where(dec_N, j_N + 1, j_N)
    new["live_N"] = c["live_N"] & ~ended_N
    return new

  def body(c, l):
    c = refill(c)
    if ch:
      c = jax.lax.cond(jnp.any(c["live_N"] & ~c["ready_N"]), lambda c: prefill_chunk(c, l), lambda c: c, c)
    return constrain(decode(c, l))

  budget = jnp.asarray(np.iinfo(np.int32).max if n_iters is None else n_iters, jnp.int32)
  going = lambda i, c: (i < budget) & unfinished(c)
  phases = phase_slots(cfg)
  if len(phases) == 1:  # one phase: one loop over the whole cache
    _, carry = jax.lax.while_loop(lambda ic: going(*ic), lambda ic: (ic[0] + 1, body(ic[1], s)),
                                  (jnp.zeros((), jnp.int32), carry))
    return carry

  # Decode phases (`SamplerConfig.phase_bounds`, as the static engine's): while every slot's next
  # write is below phase k's bound (and some is at or past phase k - 1's), the iterations run on a
  # cache of the first `phases[k]` slots, so a step reads no slot that no row has reached. The
  # phase follows the slots: when the furthest row ends and fresh rows take the slots, it drops
  # back. Each phase is a loop over a prefix sliced out of the carry's cache and written back
  # after it (XLA copies a cache sliced inside the loop at every step): the cache costs
  # S + phases[k] slots during phase k (the static engine's peak when it grows its cache to S).
  def phase_of(c):
    dec_N = c["live_N"] & c["ready_N"]
    frontier = jnp.max(jnp.where(dec_N, p - 1 + c["step_N"], -1))  # the furthest next write
    return sum((frontier >= l).astype(jnp.int32) for l in phases[:-1])

  def run_phase(k, ic):
    l = phases[k]
    i, c = ic
    full = c["cache"]
    i, c = jax.lax.while_loop(lambda ic: going(*ic) & (phase_of(ic[1]) == k),
                              lambda ic: (ic[0] + 1, body(ic[1], l)),
                              (i, constrain(dict(c, cache=cache_prefix(full, l)))))
    return i, constrain(dict(c, cache=put_cache_prefix(full, c["cache"])))

  branches = [functools.partial(run_phase, k) for k in range(len(phases))]
  _, carry = jax.lax.while_loop(lambda ic: going(*ic), lambda ic: jax.lax.switch(phase_of(ic[1]), branches, ic),
                                (jnp.zeros((), jnp.int32), carry))
  return carry


def phase_slots(cfg: SamplerConfig) -> tuple[int, ...]:
  """The cache slots each decode phase reads (ascending; `SamplerConfig.phase_bounds`)."""
  return tuple(sorted({slots for _, slots in cfg.phase_bounds()}))


def finish(c: dict, *, cfg: SamplerConfig, constrain):
  """The Rollout of a carry whose rows have all ended (the last step's top-k recorded)."""
  return constrain(decode_lib.assemble_rollout(decode_step.flush(records(c), cfg), c["pvalid_BP"], c["prompt_len_B"]))


# -- resuming a carry without its KV cache --------------------------------------------------------
# A carry's progress (`progress`) is what the rows have generated and where each slot stands; the
# rest is derived: `init` lays the prompts, keys and limits out again, and the KV cache is rebuilt
# by `reprefill` (docs/architecture.md#in-flight-weight-updates).

# The carry's entries `init` derives from the prompts, the key and the length limits, and the cache.
DERIVED = ("tokens_BP", "pvalid_BP", "prompt_len_B", "positions_BP", "positions_BS", "kv_valid_BS", "keys_B",
           "max_new_B", "cache")


def progress(c: dict, *, cfg: SamplerConfig) -> dict:
  """The carry less what `init` derives: the KV cache and the laid-out inputs dropped, `tokens_BS`
  cut to its response slots (`response_BT`; the prompt slots are the laid-out prompts)."""
  out = {k: v for k, v in c.items() if k not in DERIVED and k != "tokens_BS"}
  out["response_BT"] = c["tokens_BS"][:, cfg.max_prompt_len:]
  return out


def resume(model, layout: dict, prog: dict, *, cfg: SamplerConfig, div: int) -> dict:
  """The carry of `prog` (`progress`'s) over `layout` (`init(..., prefill=False)` of the same prompts,
  key and limits), its KV cache rebuilt by `model` (`reprefill`)."""
  c = dict(layout, **{k: v for k, v in prog.items() if k != "response_BT"})
  c["tokens_BS"] = jnp.concatenate([layout["tokens_BP"], prog["response_BT"]], axis=1)
  return reprefill(model, c, cfg=cfg, div=div)


def reprefill(model, c: dict, *, cfg: SamplerConfig, div: int) -> dict:
  """`c` with the KV cache of every live slot rebuilt by `model`: the cache slots the engine has
  written for the slot's row, from its first real prompt slot to its next write, teacher-forced
  (a slot that decodes step j next: the prompt and response tokens 0..j-2 up to slot P - 2 + j;
  one still prefilling its prompt: up to its next chunk's start). Through the refill's chunked
  prefill (`_group_chunk`): in each slot group the first slot left runs `sampler.prefill_chunk`
  slots per forward (the last chunk of a slot ends at its frontier: it may redo slots of the one
  before, same tokens), so the program's memory is the refill's. Ended and empty slots are skipped;
  cache slots past a row's frontier keep what they held (no query reads them before the engine
  writes them). Records (log q, routes, versions) are the carry's: nothing is regenerated."""
  n = c["row_N"].shape[0]
  w = min(cfg.prefill_chunk, cfg.max_len - 1)
  r_N, first_N, end_N = _written(c, cfg)

  def body(state):
    cache, at_N = state
    has_G, i_G, slot_G = _first_pending(at_N < end_N, div)
    r_G = r_N[slot_G]
    start_G = jnp.maximum(jnp.minimum(at_N[slot_G], end_N[slot_G] - w), 0)
    rows = lambda x: jax.vmap(lambda r, st: jax.lax.dynamic_slice(x, (r, st), (1, w))[0])(r_G, start_G)
    cache, _ = _group_chunk(model, cache, rows(c["tokens_BS"]), rows(c["positions_BS"]), rows(c["kv_valid_BS"]),
                            start_G, c["kv_valid_BS"][r_G], has_G, i_G, div)
    return cache, at_N.at[jnp.where(has_G, slot_G, n)].add(w, mode="drop")

  cache, _ = jax.lax.while_loop(lambda st: jnp.any(st[1] < end_N), body, (c["cache"], first_N))
  return dict(c, cache=cache)


def _written(c: dict, cfg: SamplerConfig):
  """Each slot's row (clipped), its first real prompt slot and its frontier (the slot its next write
  goes to; 0 for an ended or empty slot): the cache slots [first, frontier) hold its row's keys."""
  b = c["tokens_BS"].shape[0]
  p = cfg.max_prompt_len
  r_N = jnp.minimum(c["row_N"], b - 1)
  end_N = jnp.where(c["live_N"], jnp.where(c["ready_N"], p - 1 + c["step_N"], c["chunk_N"]), 0)
  return r_N, p - c["prompt_len_B"][r_N], end_N


def written_slots(c: dict, *, cfg: SamplerConfig):
  """[N, S] bool: the cache slots each live slot's row has written and will read (what `reprefill`
  rebuilds)."""
  _, first_N, end_N = _written(c, cfg)
  slots = jnp.arange(cfg.max_len)
  return (slots >= first_N[:, None]) & (slots < end_N[:, None])
