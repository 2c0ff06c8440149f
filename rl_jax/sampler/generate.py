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
from rl_jax.ops import native_attention
# The contract (layout, alignment) lives in rl_jax.rollout.
from rl_jax.rollout import Rollout, expert_id_dtype
from rl_jax.sampler import continuous
from rl_jax.sampler.config import SamplerConfig
from rl_jax.sampler.decode import assemble_rollout, left_pad, prefill, record_topk, sample
from rl_jax.sampler.xla_options import sampler_jit
from rl_jax.sharding import BATCH_AXES, batch_divisor, shard_batch

# ----------------------------------------------------------------------------------------
# Sampling.


# ----------------------------------------------------------------------------------------
# The generation program.


def constrainer(mesh: Mesh | None, n_kv_heads: int):
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


_STATIC_ARGNAMES = ("graphdef", "cfg", "kv_spec", "mesh")


@native_attention.per_mesh
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
  constrain = constrainer(mesh, mcfg.n_kv_heads)
  b = prompts_BP.shape[0]
  keys_B = jax.random.split(key, b)
  # Each row's own response-length limit (at most max_new_tokens): a row ends at EOS or there.
  max_new_B = (jnp.full((b,), cfg.max_new_tokens, jnp.int32) if max_new_B is None
               else jnp.minimum(jnp.asarray(max_new_B, jnp.int32), cfg.max_new_tokens))
  div = batch_divisor(mesh) if mesh is not None else 1
  if cfg.engine == "continuous":  # slots bound the rows in flight: no waves
    return continuous.generate_rows(model, prompts_BP, valid_BP, keys_B, max_new_B, cfg=cfg, kv_spec=kv_spec,
                                    constrain=constrain, div=div)
  waves = microbatch.count(b, cfg.max_rows_in_flight, "sampler.max_rows_in_flight", div)
  rows = lambda x: _generate_rows(model, *x, cfg=cfg, kv_spec=kv_spec, constrain=constrain, div=div)
  if waves == 1:
    return rows((prompts_BP, valid_BP, keys_B, max_new_B))
  _, ro = jax.lax.scan(lambda c, x: (c, rows(x)), None,
                       microbatch.split((prompts_BP, valid_BP, keys_B, max_new_B), waves))
  return constrain(microbatch.merge(ro))


def _generate_rows(model, prompts_BP, valid_BP, keys_B, max_new_B, *, cfg: SamplerConfig, kv_spec, constrain, div):
  """Prefill + decode of one wave of rows, row b sampling with `keys_B[b]` (`generate_program`)."""
  mcfg = model.cfg
  b = prompts_BP.shape[0]
  p, t, s = cfg.max_prompt_len, cfg.max_new_tokens, cfg.max_len
  n_moe, k_exp = mcfg.n_moe_layers, mcfg.n_experts_per_tok
  record_experts = cfg.record_experts and n_moe > 0
  k_rec = cfg.record_topk

  tokens_BP, pvalid_BP = constrain(left_pad(prompts_BP, valid_BP.astype(bool), p, cfg.pad_id))
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
    cache, pre_experts = prefill(model, tokens_BP, positions_BP, pvalid_BP, kv_valid_BC, slots0, cfg=cfg,
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
    y_B, trunc = sample(logits_BV, logq_BV, keys_B, j, cfg)
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
      new.update(record_topk(c, c["pending_logq_BV"], c["pending_active_B"], jnp.maximum(j - 1, 0), k_rec))
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
    c = {**c, **record_topk(c, c["pending_logq_BV"], c["pending_active_B"], c["step"] - 1, k_rec)}

  return constrain(assemble_rollout(c, pvalid_BP, prompt_len_B, trunc_keys))


_generate = sampler_jit(generate_program, static_argnames=_STATIC_ARGNAMES)


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


def resolve_kv_spec(kv_spec, cfg: SamplerConfig):
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
  kv_spec = resolve_kv_spec(kv_spec, cfg)
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


def lower_generate(graphdef: nnx.GraphDef, sampler_state: Any, prompts_BP, prompt_valid_BP, key: jax.Array,
                   cfg: SamplerConfig, mesh: Mesh | None = None):
  """`generate`'s jitted program lowered for these (possibly abstract) arguments, with the KV-cache
  format of `cfg` (`jax.stages.Lowered`: the planner compiles it, the tests compare its text)."""
  return _generate.lower(graphdef, sampler_state, prompts_BP, prompt_valid_BP, key, cfg=cfg,
                         kv_spec=resolve_kv_spec(None, cfg), mesh=mesh)


def rollout_shapes(graphdef: nnx.GraphDef, sampler_state: Any, prompts_BP, prompt_valid_BP, key: jax.Array,
                   cfg: SamplerConfig, mesh: Mesh | None = None) -> Rollout:
  """The abstract Rollout (shapes and dtypes) `generate` would return; nothing runs."""
  return jax.eval_shape(functools.partial(_generate, graphdef, cfg=cfg, kv_spec=resolve_kv_spec(None, cfg),
                                          mesh=mesh), sampler_state, prompts_BP, prompt_valid_BP, key)
