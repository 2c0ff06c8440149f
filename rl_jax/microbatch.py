"""Strided row micro-batches: split a batch so each micro-batch spans every batch-axis device, and back.

Rows of a batch are laid out over the mesh's batch axes in contiguous blocks (device d holds
rows [d B / D, (d + 1) B / D)). Micro-batch m takes rows m, m + n, m + 2n, ...: reshaping
[B] -> [B / n, n] keeps the first axis' split, so every device contributes B / (n D) of its own
rows to every micro-batch and nothing moves between devices (`split` / `merge` are local).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from rl_jax.config_utils import ConfigError


def count(rows: int, microbatch_rows: int, key: str, divisor: int = 1) -> int:
  """How many micro-batches of `microbatch_rows` rows `rows` makes (1 when 0 = off); checks the
  split is exact and that each micro-batch still divides over the mesh's batch axes."""
  if microbatch_rows <= 0 or microbatch_rows >= rows:
    return 1
  if rows % microbatch_rows:
    raise ConfigError(f"config key '{key}': {microbatch_rows} rows per micro-batch do not divide the "
                      f"{rows} rows of a batch")
  if microbatch_rows % divisor:
    raise ConfigError(f"config key '{key}': {microbatch_rows} rows per micro-batch do not split over the "
                      f"mesh's batch axes ({divisor} devices)")
  return rows // microbatch_rows


def split(tree: Any, n: int) -> Any:
  """Every leaf [B, ...] -> [n, B / n, ...], micro-batch m = rows m::n (module docstring)."""
  def one(x):
    b = x.shape[0]
    if b % n:
      raise ValueError(f"micro-batching: {b} rows do not split into {n} micro-batches")
    return jnp.swapaxes(x.reshape(b // n, n, *x.shape[1:]), 0, 1)
  return jax.tree.map(one, tree)


def merge(tree: Any) -> Any:
  """Inverse of `split`: every leaf [n, B / n, ...] -> [B, ...] in the original row order."""
  return jax.tree.map(lambda x: merge_axis(x, 0), tree)


def merge_axis(x: jax.Array, axis: int) -> jax.Array:
  """`merge` of one array whose micro-batch axis leads and whose rows sit at `axis` + 1
  ([n, L, B / n, ...] with axis = 1: a layer-stacked cache) -> rows at `axis`, B of them."""
  x = jnp.moveaxis(x, 0, axis + 1)   # [..., B / n, n, ...]: row j of micro-batch m is row j n + m
  shape = x.shape
  return x.reshape(*shape[:axis], shape[axis] * shape[axis + 1], *shape[axis + 2:])
