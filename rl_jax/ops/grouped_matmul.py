"""Grouped (ragged) matmul of expert-sorted rows: lax.ragged_dot, or a Pallas kernel that never expands to [M, E*F]."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

# y[rows of group e] = x[rows of group e] @ w[e], with the rows of x sorted by group and
# group e holding group_sizes_E[e] consecutive rows (rows past sum(group_sizes) give 0).
#
# impl:
#   "ragged_dot"  lax.ragged_dot, the reference. TPU lowers it natively; XLA:CPU (and
#                 XLA:GPU in jaxlib 0.10 outside cuDNN's bf16/f16-output fusion) rewrite it
#                 to a dense product through an [M, E*F] buffer, E times the FLOPs.
#   "pallas"      the kernels below (Triton on GPU, interpret mode elsewhere), with a
#                 custom VJP whose backward is two more grouped kernels (no dense expansion).
#                 Operands are zero-padded to whole tiles (a copy of x, and of w, only when
#                 M / D / F are not tile multiples). Checked on CPU in interpret mode and by
#                 lowering for CUDA; benchmarks/device_check.py runs it on a GPU.
#   "auto"        ragged_dot on TPU and CPU, pallas on GPU.
# The capacity-slab formulation (an [E, C, D] batched matmul, exact while no group holds
# more than C rows) is `expert_rows._capacity_experts`: it needs the per-tier switch and the
# token scatter that live there, so it is not an impl of this row-level function.
# On TPU, jax 0.10 also ships `jax.experimental.pallas.ops.tpu.megablox.gmm` (it imports);
# "auto" still takes ragged_dot there, which Mosaic lowers natively.
IMPLS = ("auto", "ragged_dot", "pallas")

# Triton dot tiles must be powers of two and at least 16 on every side.
_MIN_TILE = 16


@dataclasses.dataclass(frozen=True)
class Tiles:
  """Tile sizes (powers of two >= 16; untuned). Forward / dx: rows tm x reduction tk x
  columns tn; dw: rows tm per step, output tiles td x tf."""
  tm: int = 64
  tk: int = 64
  tn: int = 128
  td: int = 64
  tf: int = 128


@dataclasses.dataclass(frozen=True)
class _Static:
  """The hashable, non-differentiable configuration of one Pallas grouped matmul."""
  tiles: Tiles
  interpret: bool
  out_dtype: str


def resolve_impl(impl: str) -> str:
  if impl not in IMPLS:
    raise ValueError(f"grouped_matmul impl must be one of {IMPLS}, got {impl!r}")
  if impl == "auto":
    return "pallas" if jax.default_backend() == "gpu" else "ragged_dot"
  return impl


def grouped_matmul(x_MD: jax.Array, w_EDF: jax.Array, group_sizes_E: jax.Array, *,
                   impl: str = "auto", preferred_element_type=None, tiles: Tiles | None = None,
                   interpret: bool | None = None) -> jax.Array:
  """`lax.ragged_dot(x_MD, w_EDF, group_sizes_E)` -> y_MF, by `impl` (see IMPLS above).

  Output dtype: `preferred_element_type`, else the promoted input dtype (as ragged_dot).
  The Pallas path accumulates in float32 (float32 operands at HIGHEST precision) and
  needs sum(group_sizes_E) <= M (ragged_dot's contract; larger sums are clipped at M).
  `interpret` defaults to True off GPU, where there is no Triton compiler (on TPU too: use
  ragged_dot there, which Mosaic TPU lowers natively).
  """
  out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(x_MD.dtype, w_EDF.dtype))
  if resolve_impl(impl) == "ragged_dot":
    return jax.lax.ragged_dot(x_MD, w_EDF, group_sizes_E, preferred_element_type=out_dtype)
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  return _gmm_vjp(x_MD, w_EDF, group_sizes_E.astype(jnp.int32),
                  _Static(tiles or Tiles(), bool(interpret), out_dtype.name))


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def _tile(n: int, default: int) -> int:
  """A power-of-two tile >= 16, no larger than needed to cover n."""
  if default < _MIN_TILE or default & (default - 1):
    raise ValueError(f"tile sizes must be powers of two >= {_MIN_TILE}, got {default}")
  return max(_MIN_TILE, min(default, pl.next_power_of_2(n)))


def _pad2(a: jax.Array, rows: int, cols: int) -> jax.Array:
  if a.shape == (rows, cols):
    return a  # skip a no-op pad: it would still copy
  return jnp.pad(a, ((0, rows - a.shape[0]), (0, cols - a.shape[1])))


def _group_bounds(group_sizes_E: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
  """Row ranges [start_e, end_e) of the groups, clipped at M so no kernel reads past x."""
  ends_E = jnp.cumsum(group_sizes_E)
  starts_E = ends_E - group_sizes_E
  return jnp.minimum(starts_E, m).astype(jnp.int32), jnp.minimum(ends_E, m).astype(jnp.int32)


def _precision(op_dtype):
  # float32 operands: full-precision dot (IEEE on Triton, not TF32), as the reference.
  return jax.lax.Precision.HIGHEST if op_dtype == jnp.float32 else None


def _compiler_params(interpret: bool):
  if interpret:
    return None
  # Triton's params also pick the Triton backend: without them jax 0.10 lowers a pallas_call
  # to Mosaic GPU (jax_pallas_use_mosaic_gpu defaults to True), which these kernels do not target.
  from jax.experimental.pallas import triton as plgpu
  return plgpu.CompilerParams(num_warps=4, num_stages=2)


# --- forward / dx: y[tile rows, tile cols] = sum over the tile's groups, masked ---------


def _gmm_kernel(lo_ref, hi_ref, starts_ref, ends_ref, x_ref, w_ref, o_ref, *, tm, tk, nk,
                transpose_rhs, op_dtype):
  """One (tm, tn) output tile: loops over the groups that intersect its rows.

  A row tile that spans several groups computes one full-tile product per group and keeps
  each product only on that group's rows (a select, so a row never mixes two experts'
  weights; no row of another group feeds an add). Each program owns its output tile, so
  there is no cross-program accumulation (Triton runs the grid in parallel).
  """
  i = pl.program_id(0)
  rows_T = i * tm + jnp.arange(tm)
  tn = o_ref.shape[1]

  def group_body(g, acc):
    def k_body(kk, acc_g):
      k0 = pl.multiple_of(kk * tk, tk)
      x = x_ref[:, pl.ds(k0, tk)].astype(op_dtype)
      if transpose_rhs:  # w block is [E, tn, K]: contract its last axis (dx = dy @ w^T)
        w = w_ref[g, :, pl.ds(k0, tk)].astype(op_dtype)
        dims = (((1,), (1,)), ((), ()))
      else:
        w = w_ref[g, pl.ds(k0, tk), :].astype(op_dtype)
        dims = (((1,), (0,)), ((), ()))
      return acc_g + jax.lax.dot_general(x, w, dims, precision=_precision(op_dtype),
                                         preferred_element_type=jnp.float32)

    acc_g = jax.lax.fori_loop(0, nk, k_body, jnp.zeros((tm, tn), jnp.float32))
    in_group = (rows_T >= starts_ref[g]) & (rows_T < ends_ref[g])
    return jnp.where(in_group[:, None], acc_g, acc)

  acc = jax.lax.fori_loop(lo_ref[i], hi_ref[i], group_body, jnp.zeros((tm, tn), jnp.float32))
  o_ref[...] = acc.astype(o_ref.dtype)


def _gmm(x_MK, w, group_sizes_E, static: _Static, out_dtype, transpose_rhs: bool):
  """Grouped `x_MK @ w[e]` with w `[E, K, N]`, or `x_MK @ w[e]^T` with w `[E, N, K]`."""
  t = static.tiles
  m, k = x_MK.shape
  e = w.shape[0]
  n = w.shape[1] if transpose_rhs else w.shape[2]
  tm, tk, tn = _tile(m, t.tm), _tile(k, t.tk), _tile(n, t.tn)
  mp, kp, np_ = _round_up(m, tm), _round_up(k, tk), _round_up(n, tn)
  n_tiles = mp // tm
  starts_E, ends_E = _group_bounds(group_sizes_E, m)
  tile0_T = jnp.arange(n_tiles, dtype=jnp.int32) * tm
  # The groups meeting row tile i are a contiguous range [lo, hi): those ending after
  # its first row and starting before its end (an empty group inside a tile costs one
  # masked product; at most E of them in the whole grid).
  lo_T = jnp.searchsorted(ends_E, tile0_T, side="right").astype(jnp.int32)
  hi_T = jnp.searchsorted(starts_E, tile0_T + tm, side="left").astype(jnp.int32)
  x = _pad2(x_MK, mp, kp)
  if transpose_rhs:
    w_pad = w if w.shape[1:] == (np_, kp) else jnp.pad(w, ((0, 0), (0, np_ - n), (0, kp - k)))
    w_spec = pl.BlockSpec((e, tn, kp), lambda i, j: (0, j, 0))
  else:
    w_pad = w if w.shape[1:] == (kp, np_) else jnp.pad(w, ((0, 0), (0, kp - k), (0, np_ - n)))
    w_spec = pl.BlockSpec((e, kp, tn), lambda i, j: (0, 0, j))
  whole = pl.BlockSpec()  # the whole (small) metadata array
  out = pl.pallas_call(
      functools.partial(_gmm_kernel, tm=tm, tk=tk, nk=kp // tk, transpose_rhs=transpose_rhs,
                        op_dtype=jnp.result_type(x_MK.dtype, w.dtype)),
      out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype),
      grid=(n_tiles, np_ // tn),
      in_specs=[whole, whole, whole, whole, pl.BlockSpec((tm, kp), lambda i, j: (i, 0)), w_spec],
      out_specs=pl.BlockSpec((tm, tn), lambda i, j: (i, j)),
      compiler_params=_compiler_params(static.interpret), interpret=static.interpret,
      name="grouped_matmul")(lo_T, hi_T, starts_E, ends_E, x, w_pad)
  return out[:m, :n]


# --- dw: dw[e] = x_e^T dy_e, per (expert, D tile, F tile) over the group's row tiles ----


def _tgmm_kernel(lo_ref, hi_ref, starts_ref, ends_ref, x_ref, dy_ref, o_ref, *, tm, op_dtype):
  """One (td, tf) tile of dw[e]: sums x^T dy over the row tiles of group e.

  Rows of other groups in a boundary tile are zeroed in both operands (so a non-finite
  value in another group's rows cannot leak in as 0 * inf). An empty group runs no step
  and stores zeros, as ragged_dot's transpose gives.
  """
  e = pl.program_id(0)
  s, end = starts_ref[e], ends_ref[e]
  td, tf = o_ref.shape

  def row_body(r, acc):
    r0 = pl.multiple_of(r * tm, tm)
    rows_T = r0 + jnp.arange(tm)
    in_group = ((rows_T >= s) & (rows_T < end))[:, None]
    x = jnp.where(in_group, x_ref[pl.ds(r0, tm), :], 0).astype(op_dtype)
    dy = jnp.where(in_group, dy_ref[pl.ds(r0, tm), :], 0).astype(op_dtype)
    return acc + jax.lax.dot_general(x, dy, (((0,), (0,)), ((), ())),
                                     precision=_precision(op_dtype),
                                     preferred_element_type=jnp.float32)

  acc = jax.lax.fori_loop(lo_ref[e], hi_ref[e], row_body, jnp.zeros((td, tf), jnp.float32))
  o_ref[...] = acc.astype(o_ref.dtype)


def _tgmm(x_MD, dy_MF, group_sizes_E, static: _Static, out_dtype):
  """`dw[e] = x[rows of e]^T @ dy[rows of e]` -> `[E, D, F]`."""
  t = static.tiles
  m, d = x_MD.shape
  f = dy_MF.shape[1]
  e = group_sizes_E.shape[0]
  tm, td, tf = _tile(m, t.tm), _tile(d, t.td), _tile(f, t.tf)
  mp, dp, fp = _round_up(m, tm), _round_up(d, td), _round_up(f, tf)
  starts_E, ends_E = _group_bounds(group_sizes_E, m)
  # Row tiles of group e: [start // tm, ceil(end / tm)), none for an empty group.
  lo_E = (starts_E // tm).astype(jnp.int32)
  hi_E = jnp.where(ends_E > starts_E, -(-ends_E // tm), lo_E).astype(jnp.int32)
  whole = pl.BlockSpec()  # the whole (small) metadata array
  out = pl.pallas_call(
      functools.partial(_tgmm_kernel, tm=tm, op_dtype=jnp.result_type(x_MD.dtype, dy_MF.dtype)),
      out_shape=jax.ShapeDtypeStruct((e, dp, fp), out_dtype),
      grid=(e, dp // td, fp // tf),
      in_specs=[whole, whole, whole, whole, pl.BlockSpec((mp, td), lambda g, i, j: (0, i)),
                pl.BlockSpec((mp, tf), lambda g, i, j: (0, j))],
      out_specs=pl.BlockSpec((None, td, tf), lambda g, i, j: (g, i, j)),
      compiler_params=_compiler_params(static.interpret), interpret=static.interpret,
      name="grouped_matmul_dw")(lo_E, hi_E, starts_E, ends_E, _pad2(x_MD, mp, dp),
                                _pad2(dy_MF, mp, fp))
  return out[:, :d, :f]


# --- custom VJP ---------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gmm_vjp(x_MD, w_EDF, group_sizes_E, static: _Static):
  return _gmm(x_MD, w_EDF, group_sizes_E, static, jnp.dtype(static.out_dtype), False)


def _gmm_fwd(x_MD, w_EDF, group_sizes_E, static):
  return _gmm_vjp(x_MD, w_EDF, group_sizes_E, static), (x_MD, w_EDF, group_sizes_E)


def _gmm_bwd(static, res, dy_MF):
  x_MD, w_EDF, group_sizes_E = res
  # dx = grouped dy @ w[e]^T, reading w's tiles transposed (no [E, F, D] copy of w).
  dx_MD = _gmm(dy_MF, w_EDF, group_sizes_E, static, x_MD.dtype, True)
  dw_EDF = _tgmm(x_MD, dy_MF, group_sizes_E, static, w_EDF.dtype)
  # group_sizes are integers: a float0 zero cotangent.
  dgs = np.zeros(group_sizes_E.shape, jax.dtypes.float0)
  return dx_MD, dw_EDF, dgs


_gmm_vjp.defvjp(_gmm_fwd, _gmm_bwd)


def grouped_product(x_NK: jax.Array, w_EKN: jax.Array, group_sizes_E: jax.Array, impl: str,
                    **kw) -> jax.Array:
  """The experts' product as `ops.linear` / `ops.quantized` run it: `lax.ragged_dot` with `kw` as
  given ("ragged_dot"), or the Pallas grouped matmul ("pallas", no dense expansion)."""
  if impl == "ragged_dot":
    return jax.lax.ragged_dot(x_NK, w_EKN, group_sizes_E, **kw)
  if impl != "pallas":
    raise ValueError(f"grouped matmul impl must be 'ragged_dot' or 'pallas', got {impl!r}")
  kw.pop("precision", None)  # the kernel runs float32 operands at HIGHEST itself
  return grouped_matmul(x_NK, w_EKN, group_sizes_E, impl="pallas", **kw)
