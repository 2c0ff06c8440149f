"""The sampler's side of an RL run behind one interface: weight sync, generation, chunked rollouts, their shapes."""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping, Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from rl_jax import rollout as rollout_lib
from rl_jax.sampler import chunked
from rl_jax.sampler import generate as gen
from rl_jax.sampler import weights as sampler_weights
from rl_jax.sampler.config import SamplerConfig

# What each kind of generation samples with: its weights' graph, its config and the role whose mesh runs it.
KINDS = ("rollout", "greedy", "sampled")
ROLES = ("rollout", "eval")


class Sampler(Protocol):
  """The seam a sampler backend implements (docs/architecture.md#the-sampler-seam): what the run loop,
  the planner and the checkpoints call. `SamplerPrograms` is this codebase's (the jitted engines of
  rl_jax/sampler/); another backend (a server, another engine) provides the same methods over its
  own weights and returns the same `Rollout` contract (rl_jax/rollout.py)."""

  def sync(self, params, delta): ...                                         # trainer params -> sampler weights
  def clean_weights(self, params): ...                                       # the evaluation's weights
  def generate(self, state, prompts_BP, valid_BP, key, kind: str = "rollout") -> rollout_lib.Rollout: ...
  def start_rollout(self, state, prompts_BP, valid_BP, key, *, version: int, n_iters: int): ...
  def advance_rollout(self, state, carry, *, version: int, n_iters: int): ...
  def finish_rollout(self, carry) -> rollout_lib.Rollout: ...
  def rollout_progress(self, carry) -> dict: ...
  def resume_rollout(self, state, prompts_BP, valid_BP, key, progress): ...


@dataclasses.dataclass(frozen=True)
class SamplerPrograms:
  """`Sampler` by the jitted engines: the rollout's weights graph and config, the evaluation's
  (float32, clean), the parameters its sync quantizes, and the mesh of each role (`meshes`:
  'rollout' the sampler's devices, which async RL may split off; 'eval' the trainer's). Fields of
  what a job does not define (`rl.programs.build_local`) are None."""
  cfg: SamplerConfig | None
  graphdef: nnx.GraphDef | None
  meshes: Mapping[str, Any]
  quant_plan: Any = None
  eval_graphdef: nnx.GraphDef | None = None
  eval_cfg: SamplerConfig | None = None
  eval_sampled_cfg: SamplerConfig | None = None

  def __post_init__(self):
    if set(self.meshes) != set(ROLES):
      raise ValueError(f"SamplerPrograms.meshes: one mesh per role {ROLES}, got {sorted(self.meshes)}")

  def _of(self, kind: str):
    """(graph, config, mesh) of a generation `kind`."""
    if kind == "rollout":
      return self.graphdef, self.cfg, self.meshes["rollout"]
    if kind in ("greedy", "sampled"):
      return self.eval_graphdef, self.eval_cfg if kind == "greedy" else self.eval_sampled_cfg, self.meshes["eval"]
    raise ValueError(f"generate kind {kind!r}: one of {list(KINDS)}")

  # -- weights --------------------------------------------------------------------------------

  def sync(self, params, delta):
    """Sampler weights cast(quantize(params + delta)) (`sampler_weights.sync_weights`)."""
    return sampler_weights.sync_weights(params, delta, self.cfg.quant, self.cfg.dtype, self.quant_plan)

  def lower_sync(self, params, delta):
    """`sync`'s program lowered for these (possibly abstract) arguments."""
    return sampler_weights.lower_sync(params, delta, self.cfg.quant, self.cfg.dtype, self.quant_plan)

  def clean_weights(self, params):
    """The float32 evaluation weights (no noise, no quantization)."""
    return sampler_weights.sync_weights(params, None, None, "float32")

  # -- one program per generation -------------------------------------------------------------

  def generate(self, state, prompts_BP, valid_BP, key, kind: str = "rollout") -> rollout_lib.Rollout:
    """`kind` 'rollout' (the sampler's weights and config), 'greedy' / 'sampled' (evaluation)."""
    graphdef, cfg, mesh = self._of(kind)
    return gen.generate(graphdef, state, prompts_BP, valid_BP, key, cfg, mesh=mesh)

  def lower_generate(self, state, prompts_BP, valid_BP, key, kind: str = "rollout"):
    """`generate`'s program of `kind` lowered for these (possibly abstract) arguments."""
    graphdef, cfg, mesh = self._of(kind)
    return gen.lower_generate(graphdef, state, prompts_BP, valid_BP, key, cfg, mesh=mesh)

  def rollout_shapes(self, state, prompts_BP, valid_BP, key) -> rollout_lib.Rollout:
    """The abstract Rollout of a rollout `generate` (shapes and dtypes; nothing runs)."""
    graphdef, cfg, mesh = self._of("rollout")
    return gen.rollout_shapes(graphdef, state, prompts_BP, valid_BP, key, cfg, mesh=mesh)

  # -- a rollout in chunks (in-flight weight updates: rl_jax/sampler/chunked.py) ---------------

  def start_rollout(self, state, prompts_BP, valid_BP, key, *, version: int, n_iters: int):
    """A rollout `generate` begun: its carry after at most `n_iters` engine iterations at `version`."""
    return chunked.start(self.graphdef, state, prompts_BP, valid_BP, key, self.cfg, version=version,
                         n_iters=n_iters, mesh=self.meshes["rollout"])

  def advance_rollout(self, state, carry, *, version: int, n_iters: int = chunked.TO_THE_END):
    """`carry` (donated) continued by the weights `state` of `version`, at most `n_iters` iterations."""
    return chunked.advance(self.graphdef, state, carry, self.cfg, version=version, n_iters=n_iters,
                           mesh=self.meshes["rollout"])

  def finish_rollout(self, carry) -> rollout_lib.Rollout:
    """The Rollout of a carry advanced to its end."""
    return chunked.finish(carry, self.cfg, mesh=self.meshes["rollout"])

  def rollout_carry_shapes(self, state, prompts_BP, valid_BP, key):
    """The abstract carry of `start_rollout` (shapes and dtypes; nothing runs)."""
    kv_spec = gen.resolve_kv_spec(None, self.cfg)
    return jax.eval_shape(functools.partial(chunked.start_program, self.graphdef, cfg=self.cfg, kv_spec=kv_spec,
                                            mesh=self.meshes["rollout"]), state, prompts_BP, valid_BP, key, None,
                          jnp.int32(0), jnp.int32(1))

  def rollout_progress(self, carry) -> dict:
    """`carry`'s progress: the carry less its KV cache and what the prompts and key derive (a
    checkpoint's form under `rl.inflight_resume='reprefill'`)."""
    return chunked.progress(carry, self.cfg, mesh=self.meshes["rollout"])

  def rollout_progress_shapes(self, abstract_carry) -> dict:
    """`rollout_progress`'s abstract output (nothing runs)."""
    return chunked.progress_shapes(abstract_carry, self.cfg)

  def resume_rollout(self, state, prompts_BP, valid_BP, key, progress):
    """The carry of `progress` (the rollout's `start_rollout` arguments again), its KV cache
    re-prefilled by the weights `state`."""
    return chunked.resume(self.graphdef, state, prompts_BP, valid_BP, key, progress, self.cfg,
                          mesh=self.meshes["rollout"])
