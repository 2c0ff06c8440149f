"""The continuous engine in chunks: `start` a rollout, `advance` it with whatever weights, `finish` it."""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from rl_jax.ops import native_attention
from rl_jax.rollout import Rollout
from rl_jax.sampler import continuous
from rl_jax.sampler import generate as gen
from rl_jax.sampler.config import SamplerConfig
from rl_jax.sampler.xla_options import sampler_jit
from rl_jax.sharding import batch_divisor, shard_batch

# In-flight weight updates (docs/architecture.md#the-sampler-engines): the continuous engine's
# `lax.while_loop` cut into programs of at most `n_iters` iterations. The carry (slots, KV cache,
# the rows' buffers) passes from one to the next, so between two of them the caller may swap
# the weights; `version` is recorded for every token the next one samples (`Rollout.version_BT`).
# The iterations run in the same order whatever the cuts: with the same weights throughout, the
# rollout is the one-program `generate`'s bit for bit (tests/test_inflight_updates.py).

# `n_iters` of an `advance` that runs to the end.
TO_THE_END = np.iinfo(np.int32).max
_STATIC = ("graphdef", "cfg", "kv_spec", "mesh")


def _check(cfg: SamplerConfig) -> None:
  if cfg.engine != "continuous":
    raise ValueError(f"chunked generation runs the continuous engine; sampler.engine={cfg.engine!r}")


@native_attention.per_mesh
def start_program(graphdef, state, prompts_BP, valid_BP, key, max_new_B, version, n_iters, *, cfg: SamplerConfig,
                  kv_spec, mesh) -> dict:
  """The carry after the prefill of the first slots and at most `n_iters` iterations at `version`."""
  model, constrain, div = _engine(graphdef, state, cfg, mesh)
  carry = _init(model, prompts_BP, valid_BP, key, max_new_B, cfg=cfg, kv_spec=kv_spec, constrain=constrain, div=div,
                prefill=True)
  return continuous.run(model, carry, cfg=cfg, constrain=constrain, div=div, version=version, n_iters=n_iters)


def _engine(graphdef, state, cfg: SamplerConfig, mesh):
  """(model, the cache constrainer, the batch divisor) of a program that starts the engine."""
  _check(cfg)
  model = nnx.merge(graphdef, state)
  cfg.check_vocab(model.cfg.vocab_size)
  return model, gen.constrainer(mesh, model.cfg.n_kv_heads), batch_divisor(mesh) if mesh is not None else 1


def _init(model, prompts_BP, valid_BP, key, max_new_B, *, cfg: SamplerConfig, kv_spec, constrain, div, prefill: bool):
  """`continuous.init` of the step's prompts: a key per row, each row's limit clamped to the config's."""
  b = prompts_BP.shape[0]
  max_new_B = (jnp.full((b,), cfg.max_new_tokens, jnp.int32) if max_new_B is None
               else jnp.minimum(jnp.asarray(max_new_B, jnp.int32), cfg.max_new_tokens))
  return continuous.init(model, prompts_BP, valid_BP, jax.random.split(key, b), max_new_B, cfg=cfg,
                         kv_spec=kv_spec, constrain=constrain, div=div, versions=True, prefill=prefill)


@native_attention.per_mesh
def advance_program(graphdef, state, carry, version, n_iters, *, cfg: SamplerConfig, kv_spec, mesh) -> dict:
  """At most `n_iters` more iterations of `carry`, sampled by `state` and recorded as `version`."""
  del kv_spec  # the cache's format is the carry's
  model = nnx.merge(graphdef, state)
  constrain = gen.constrainer(mesh, model.cfg.n_kv_heads)
  return continuous.run(model, carry, cfg=cfg, constrain=constrain, div=batch_divisor(mesh) if mesh is not None else 1,
                        version=version, n_iters=n_iters)


def finish_program(carry, *, cfg: SamplerConfig, mesh) -> Rollout:
  # The Rollout holds no KV cache: only its rows' sharding is constrained (heads count unused).
  constrain = gen.constrainer(mesh, 1)
  return continuous.finish(carry, cfg=cfg, constrain=constrain)


def progress_program(carry, *, cfg: SamplerConfig, mesh) -> dict:
  # The progress holds no KV cache: only its rows' and slots' sharding is constrained.
  return gen.constrainer(mesh, 1)(continuous.progress(carry, cfg=cfg))


@native_attention.per_mesh
def resume_program(graphdef, state, prompts_BP, valid_BP, key, max_new_B, progress, *, cfg: SamplerConfig, kv_spec,
                   mesh) -> dict:
  """The carry of `progress` (`start_program`'s prompts, key and limits laid out again), its KV
  cache rebuilt by `state` (`continuous.reprefill`)."""
  model, constrain, div = _engine(graphdef, state, cfg, mesh)
  layout = _init(model, prompts_BP, valid_BP, key, max_new_B, cfg=cfg, kv_spec=kv_spec, constrain=constrain, div=div,
                 prefill=False)
  return constrain(continuous.resume(model, layout, progress, cfg=cfg, div=div))


_start = sampler_jit(start_program, static_argnames=_STATIC)
# The carry is donated: its KV cache is updated in place, chunk after chunk.
_advance = sampler_jit(advance_program, static_argnames=_STATIC, donate_argnames=("carry",))
_finish = sampler_jit(finish_program, static_argnames=("cfg", "mesh"))
_unfinished = sampler_jit(continuous.unfinished)
_progress = sampler_jit(progress_program, static_argnames=("cfg", "mesh"))
_resume = sampler_jit(resume_program, static_argnames=_STATIC)


def _layout_prompts(prompts_BP, prompt_valid_BP, cfg: SamplerConfig, mesh, max_new_B):
  """The prompts checked and put on device (over the mesh's batch axes), as `start` takes them."""
  gen.check_prompts(prompts_BP, prompt_valid_BP, cfg)
  prompts_BP = jnp.asarray(prompts_BP, jnp.int32)
  prompt_valid_BP = jnp.asarray(prompt_valid_BP, bool)
  if mesh is not None:
    prompts_BP, prompt_valid_BP = shard_batch((prompts_BP, prompt_valid_BP), mesh)
    if max_new_B is not None:
      max_new_B = shard_batch(jnp.asarray(max_new_B, jnp.int32), mesh)
  return prompts_BP, prompt_valid_BP, max_new_B


def start(graphdef: nnx.GraphDef, state: Any, prompts_BP, prompt_valid_BP, key: jax.Array, cfg: SamplerConfig, *,
          version: int, n_iters: int, mesh: Mesh | None = None, max_new_B=None) -> dict:
  """`generate`'s rollout begun: prompts checked and laid out, the first slots prefilled, at most
  `n_iters` engine iterations (one decode step of every ready slot each) sampled by `state` as
  policy `version`. Returns the carry (on device; dispatched, not waited for)."""
  _check(cfg)
  prompts_BP, prompt_valid_BP, max_new_B = _layout_prompts(prompts_BP, prompt_valid_BP, cfg, mesh, max_new_B)
  return _start(graphdef, state, prompts_BP, prompt_valid_BP, key, max_new_B, jnp.int32(version),
                jnp.int32(n_iters), cfg=cfg, kv_spec=gen.resolve_kv_spec(None, cfg), mesh=mesh)


def advance(graphdef: nnx.GraphDef, state: Any, carry: dict, cfg: SamplerConfig, *, version: int,
            n_iters: int = TO_THE_END, mesh: Mesh | None = None) -> dict:
  """`carry` continued for at most `n_iters` iterations (default: to its end) by `state` as policy
  `version`; `carry` is donated (use the returned one)."""
  return _advance(graphdef, state, carry, jnp.int32(version), jnp.int32(n_iters), cfg=cfg,
                  kv_spec=gen.resolve_kv_spec(None, cfg), mesh=mesh)


def finish(carry: dict, cfg: SamplerConfig, *, mesh: Mesh | None = None) -> Rollout:
  """The Rollout of a carry that has run to its end (`advance` with no limit), `version_BT` included."""
  return _finish(carry, cfg=cfg, mesh=mesh)


def unfinished(carry: dict) -> bool:
  """Whether rows are left (waits for the carry)."""
  return bool(_unfinished(carry))


def progress(carry: dict, cfg: SamplerConfig, *, mesh: Mesh | None = None) -> dict:
  """The carry less its KV cache and what `start`'s arguments derive (`continuous.progress`): what a
  checkpoint keeps of a rollout in generation under `rl.inflight_resume='reprefill'`."""
  return _progress(carry, cfg=cfg, mesh=mesh)


def progress_shapes(abstract_carry: dict, cfg: SamplerConfig) -> dict:
  """`progress`'s abstract output (shapes and dtypes) for an abstract carry (nothing runs)."""
  return jax.eval_shape(functools.partial(continuous.progress, cfg=cfg), abstract_carry)


def resume(graphdef: nnx.GraphDef, state: Any, prompts_BP, prompt_valid_BP, key: jax.Array, progress_: dict,
           cfg: SamplerConfig, *, mesh: Mesh | None = None, max_new_B=None) -> dict:
  """The carry `progress_` came from, for `advance` to continue: `start`'s arguments (the same
  prompts, key and limits) laid out again and every live slot's KV cache re-prefilled by `state`
  (`continuous.reprefill`). With the weights that wrote the cache, and in the batch-invariant mode,
  the rebuilt cache is the carry's bit for bit where its rows read it (tests/test_inflight_updates.py)."""
  _check(cfg)
  prompts_BP, prompt_valid_BP, max_new_B = _layout_prompts(prompts_BP, prompt_valid_BP, cfg, mesh, max_new_B)
  return _resume(graphdef, state, prompts_BP, prompt_valid_BP, key, max_new_B, progress_, cfg=cfg,
                 kv_spec=gen.resolve_kv_spec(None, cfg), mesh=mesh)
