"""Sampler weights from the trainer's: fixed weight noise, quantization, cast (one jitted sync)."""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from rl_jax.config_utils import ConfigError
from rl_jax.models.config import ModelConfig
from rl_jax.models.layers import dtype_of
from rl_jax.models import families
from rl_jax.models.quantize import plan_of, quantize_params
from rl_jax.quant.qtensor import QTensor

def _is_quantized(x) -> bool:
  return isinstance(x, QTensor)


def _is_float(x) -> bool:
  return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def make_noise(params_state: Any, mode: str, sigma: float, key: jax.Array) -> Any | None:
  """The fixed sampler offset `Delta` of [SC] Sec. 5.2 (docs/math.md#mismatch-sources), drawn once.

  `theta_sampler = theta_trainer + Delta` with
    - 'relative': `Delta = sigma * eps * w0`, `w0` = `params_state` (pass the *initial*
      weights, what the paper's own code scales by),
    - 'absolute': `Delta = sigma * eps`, i.e. `Delta ~ N(0, sigma^2)`,
  `eps ~ N(0, 1)` i.i.d. per element. Returns None for mode 'none' (no noise).

  Which leaves: every floating parameter tensor (embeddings, attention / MLP / expert
  matrices, the MoE router, and the RMSNorm scales). The paper draws `Delta` from an
  *isotropic* Gaussian over `theta` with no exclusions, so excluding norms would be a
  different perturbation; under 'relative' a norm scale (w0 = 1) gets `sigma * eps`,
  the same relative size as every other weight. Integer leaves (none in this model) are
  left alone. `Delta` is float32 so that adding it to bf16 trainer weights loses nothing
  before the sampler cast.
  """
  if mode == "none":
    return None
  if mode not in ("relative", "absolute"):
    raise ConfigError(f"config key 'sampler.noise': {mode!r} is not one of ['none', 'relative', 'absolute']")
  leaves, treedef = jax.tree.flatten(params_state)
  keys = jax.random.split(key, len(leaves))
  sigma = jnp.float32(sigma)
  # One small program per distinct (shape, dtype, sharding), reused across layers: a
  # single jit over the whole tree would inline one threefry per leaf, and its compile
  # time would grow with depth.
  relative = jnp.asarray(mode == "relative")
  delta = [_leaf_noise(k, w, sigma, relative) if _is_float(w) else jnp.zeros_like(w)
           for k, w in zip(keys, leaves)]
  return jax.tree.unflatten(treedef, delta)


@jax.jit
def _leaf_noise(key, w, sigma, relative):
  eps = jax.random.normal(key, w.shape, jnp.float32)
  return sigma * eps * jnp.where(relative, w.astype(jnp.float32), 1.0)


@functools.partial(jax.jit, static_argnames=("qcfg", "dtype", "plan"))
def _sync(params_state, delta, qcfg, dtype, plan=None):
  state = params_state
  if delta is not None:
    state = jax.tree.map(lambda w, d: (w.astype(jnp.float32) + d).astype(w.dtype) if _is_float(w) else w,
                         state, delta)
  if qcfg is not None and not _is_noop_quant(qcfg):
    state = quantize_params(state, qcfg, plan)
  target = dtype_of(dtype)
  # QTensors keep their own storage and scale dtypes; only plain float leaves are cast.
  return jax.tree.map(lambda w: w if _is_quantized(w) or not _is_float(w) else w.astype(target),
                      state, is_leaf=_is_quantized)


def _is_noop_quant(qcfg) -> bool:
  """True when weights and activations stay fp32 (nothing for `quantize_params` to do)."""
  fmts = [getattr(getattr(qcfg, s, None), "format", "fp32") for s in ("weights", "activations")]
  return all(f in ("fp32", None) for f in fmts)


def sync_weights(params_state: Any, delta: Any | None, qcfg: Any, dtype: str, plan: Any = None) -> Any:
  """Sampler weights from the trainer's: `cast(quantize(params + Delta))`, in that order.

  One jitted program per (parameter shapes, qcfg, dtype, plan): calling it after every trainer
  step (or every K steps, the trainer's staleness policy) never recompiles. `qcfg` is a
  `QuantConfig` (weights / activations are quantized by `quantize_params`; the KV-cache
  section is used by `generate` through `init_cache(kv_spec=qcfg.kv)`), or None. `plan`
  (`quant_plan(model_cfg)`) names the leaves to quantize by the model's parameter tags; a pure
  dict without one is matched by name (`models.quantize.tagged_names`).
  The trainer's parameters are not donated: the trainer keeps using them.
  """
  return _sync(params_state, delta, qcfg, dtype, plan)


def lower_sync(params_state: Any, delta: Any | None, qcfg: Any, dtype: str, plan: Any = None):
  """`sync_weights`' program lowered for these (possibly abstract) arguments (`jax.stages.Lowered`):
  what the planner compiles and the tests compare."""
  return _sync.lower(params_state, delta, qcfg=qcfg, dtype=dtype, plan=plan)


@functools.lru_cache(maxsize=None)
def quant_plan(model_cfg: ModelConfig):
  """The `models.quantize.QuantPlan` of the model of `model_cfg` (its parameter tags, read from the
  abstract model: nothing allocated); its paths are `nnx.to_pure_dict`'s of the trainer's state."""
  return plan_of(nnx.state(families.abstract_model(model_cfg)))


def sampler_graphdef(model_cfg: ModelConfig, dtype: str) -> nnx.GraphDef:
  """The graph of the sampler model: the trainer's architecture computing in `dtype`.

  Built abstractly (no parameters are materialized); merge it with `sync_weights`' output.
  """
  cfg = dataclasses.replace(model_cfg, dtype=dtype, param_dtype=dtype, remat=False)
  abstract = families.abstract_model(cfg)
  graphdef, _ = nnx.split(abstract)
  return graphdef
