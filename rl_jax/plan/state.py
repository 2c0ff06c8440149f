"""The step's state as abstract arrays (shapes and shardings, no memory) and its per-device bytes."""
from __future__ import annotations

from typing import Any

from flax import nnx
import jax
import numpy as np

from rl_jax import sharding as sh
from rl_jax import train_state
from rl_jax.models.kv_cache import init_cache
from rl_jax.models.layers import dtype_of


def sds(shape_dtype, sharding):
  return jax.ShapeDtypeStruct(shape_dtype.shape, shape_dtype.dtype, sharding=sharding)


def device_bytes(tree: Any) -> int:
  """Per-device bytes of a tree of sharded ShapeDtypeStructs or arrays (the largest shard)."""
  total = 0
  for x in jax.tree.leaves(tree):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      itemsize = 8  # a threefry key: two uint32
    else:
      itemsize = np.dtype(x.dtype).itemsize
    shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
    total += int(np.prod(shape, dtype=np.int64)) * itemsize
  return total


def abstract_params(model_cfg, mesh):
  """(graphdef, params as sharded ShapeDtypeStructs): what `train_state.init_params` would place."""
  graphdef, abstract = train_state.abstract_state(model_cfg)
  return graphdef, jax.tree.map(sds, nnx.to_pure_dict(abstract), sh.param_shardings(abstract, mesh))


def abstract_opt_state(optimizer, params, mesh):
  """Optimizer state with the shardings `train_state.init_opt_state` gives it (no memory)."""
  return jax.tree.map(sds, jax.eval_shape(optimizer.init, params),
                      train_state.opt_state_shardings(optimizer, params, mesh))


def opt_state_like_params(opt_state, params):
  """The optimizer state with every leaf that mirrors a parameter (same path suffix, same shape)
  sharded like that parameter: the layout `train_state.init_opt_state` produces."""
  return jax.tree.map(sds, opt_state, train_state.mirror_shardings(opt_state, params, None))


def kv_cache_sizing(model_cfg, sampler_cfg, rows: int, kv_spec, mesh) -> tuple[int, str]:
  """(per-device bytes, the product that gives them) of a KV cache for `rows` rows in flight (the
  continuous engine's slots, or a wave of the static engine's rows): rows per device (the batch
  axes split them) x S = P + T cache slots x layers x 2 (K and V) x kv heads per device ('tensor'
  splits them when it divides them) x head dim x bytes per element, plus the per-slot scales of a
  quantized format. Read off one row of `init_cache`'s layout, so packing and scale dtypes are
  the cache's own."""
  s = sampler_cfg.max_len
  cache = jax.eval_shape(lambda: init_cache(model_cfg, 1, s, dtype_of(sampler_cfg.dtype), kv_spec,
                                            backend=getattr(sampler_cfg.quant, "backend", "auto")))
  nbytes = lambda x: int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
  values = sum(nbytes(kv.k) + nbytes(kv.v) for kv in cache)
  scales = sum(nbytes(kv.k_scale) + nbytes(kv.v_scale) for kv in cache if kv.k_scale is not None)
  div, tp = sh.batch_divisor(mesh), mesh.shape["tensor"]
  heads = model_cfg.n_kv_heads // tp if model_cfg.n_kv_heads % tp == 0 else model_cfg.n_kv_heads
  per_dev = -(-rows // div)
  layers, d = model_cfg.n_layers, model_cfg.head_dim
  elem = values / (s * layers * 2 * model_cfg.n_kv_heads * d)
  total = per_dev * (values + scales) * heads // model_cfg.n_kv_heads
  fmt = getattr(kv_spec, "format", None) or sampler_cfg.dtype
  text = (f"{per_dev} rows per device ({rows} over {div}) x S {s} (P {sampler_cfg.max_prompt_len} + T "
          f"{sampler_cfg.max_new_tokens}) x {layers} layers x 2 (K, V) x {heads} kv heads x {d} head dim x "
          f"{elem:g} B ({fmt})" + (f" + scales {scales / values:.3g} x that" if scales else "")
          + f" = {total / 2**30:.2f} GiB")
  return total, text
