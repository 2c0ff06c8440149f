"""The sampler's jit entry: prefill + KV-cache decode by the config's engine, recording logq, top-k and routes on device."""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from rl_jax.models.kv_cache import LayerKV
from rl_jax.ops import native_attention
# The contract (layout, alignment) lives in rl_jax.rollout.
from rl_jax.rollout import Rollout
from rl_jax.sampler import continuous
from rl_jax.sampler import static
from rl_jax.sampler.config import SamplerConfig
from rl_jax.sampler.xla_options import sampler_jit
from rl_jax.sharding import BATCH_AXES, batch_divisor, shard_batch

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
  """The traceable generation program (`_generate` is its jit; tests wrap it to count traces): the
  config's engine (`static.generate_rows`, `continuous.generate_rows`) over the rows, row b
  sampling with the b-th of `split(key, B)` whatever the engine, waves or slots."""
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
  engine = continuous if cfg.engine == "continuous" else static
  return engine.generate_rows(model, prompts_BP, valid_BP, keys_B, max_new_B, cfg=cfg, kv_spec=kv_spec,
                              constrain=constrain, div=div)


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
