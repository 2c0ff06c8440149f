"""Expert FFN over routed rows: every (token, slot) pair through its expert's SwiGLU, dropless
(capacity slabs with exact fallback rounds, the Pallas grouped matmul or lax.ragged_dot); shared by
`moe` and `expert_parallel`, below both."""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from rl_jax import impl_log
from rl_jax.ops import batch_invariant as invariant
from rl_jax.ops.linear import ragged_linear
from rl_jax.quant.qtensor import QTensor


# Slots per expert of the capacity path, as multiples of the mean load M / E, tried in order:
# the smallest tier that holds the busiest expert runs, and routing more skewed than the last
# tier takes the exact fallback. 1.25x is 1.6x less slab than 2x alone, whose empty half is
# all padding; at random init (issue 15's MoE: 32 x 160 tokens, 8 experts, top-2; max / mean
# load 1.11-1.49) two of the four layers fit it and the update went from 1.26 to 1.18 s.
CAPACITY_TIERS = (1.25, 2.0)


# `_ragged_rows`' grouped-product impl (ops.linear.ragged_linear) per resolved expert matmul; the
# slab path's quantized weights keep ragged_dot.
_ROW_IMPL = {"slab": "ragged_dot", "ragged_dot": "ragged_dot", "grouped": "pallas"}


# `_sort_by_expert` counts instead of sorting when the groups are few and the rows many: XLA:CPU's
# sort of the s32[18432] ids of the study model's update (4 experts + padding, top-2) takes ~6.1 ms
# on one thread, the counting ~1.5 ms; with 129 groups the [M, groups] prefix sum is ~7x the sort,
# and at a decode step's 512 rows the sort is as fast
# (docs/performance.md#the-moe-dispatchs-sort-issue-54-item-3-2026-12-07).
_COUNT_MAX_GROUPS, _COUNT_MIN_ROWS = 16, 2048


def _sort_by_expert(flat_ids_M, n_groups: int):
  """(order_M, rank_M): the stable sort by id of M ids in [0, n_groups) (order: the assignment at
  each sorted position; rank: each assignment's sorted position), as `argsort(stable=True)` gives it.
  Few groups: a counting sort (each id's start plus the same ids before it), no sort."""
  m = flat_ids_M.shape[0]
  arange_M = jnp.arange(m, dtype=jnp.int32)
  if n_groups > _COUNT_MAX_GROUPS or m < _COUNT_MIN_ROWS:
    order_M = jnp.argsort(flat_ids_M, stable=True).astype(jnp.int32)
    return order_M, jnp.zeros_like(order_M).at[order_M].set(arange_M)
  onehot_MG = (flat_ids_M[:, None] == jnp.arange(n_groups, dtype=flat_ids_M.dtype)).astype(jnp.int32)
  before_M = jnp.sum((jnp.cumsum(onehot_MG, axis=0) - onehot_MG) * onehot_MG, axis=1)
  sizes_G = jnp.sum(onehot_MG, axis=0)
  rank_M = (jnp.cumsum(sizes_G) - sizes_G)[flat_ids_M] + before_M
  return jnp.zeros_like(rank_M).at[rank_M].set(arange_M), rank_M


def _combine(y_NKD, gates_NK):
  """Sum of each token's K slot outputs weighted by its gates -> y_ND."""
  return jnp.einsum("nkd,nk->nd", y_NKD, gates_NK.astype(y_NKD.dtype))


def _ragged_rows(x_ND, ids_NK, w_gate, w_up, w_down, n_experts: int, impl: str = "ragged_dot"):
  """Ungated SwiGLU output y_NKD of every (token, slot) pair by its expert, as a grouped product of
  the expert-sorted rows: `lax.ragged_dot` (`impl` "ragged_dot") or the Pallas grouped matmul
  ("pallas": `[M, D]` and `[M, F]` rows, never `[M, E * F]`, forward and backward).

  An id equal to `n_experts` means "no expert" (the all-to-all dispatch's padding rows): it sorts
  after every group and its row is zero.
  """
  n, k = ids_NK.shape
  flat_ids_M = ids_NK.reshape(-1)  # M = N * K (token, slot) assignments
  order_M, _ = _sort_by_expert(flat_ids_M, n_experts + 1)
  x_MD = x_ND[order_M // k]
  group_sizes_E = jnp.bincount(flat_ids_M, length=n_experts + 1)[:n_experts].astype(jnp.int32)
  h_MF = (jax.nn.silu(ragged_linear(x_MD, w_gate, group_sizes_E, impl))
          * ragged_linear(x_MD, w_up, group_sizes_E, impl))
  y_MD = ragged_linear(h_MF, w_down, group_sizes_E, impl)
  y_NKD = jnp.zeros_like(y_MD).at[order_M].set(y_MD).reshape(n, k, -1)
  # Rows past the groups are not defined by ragged_dot's contract: zero them explicitly.
  return jnp.where((ids_NK < n_experts)[..., None], y_NKD, 0)


def ragged_experts(x_ND, ids_NK, gates_NK, w_gate, w_up, w_down, n_experts: int):
  """SwiGLU experts over (token, slot) pairs sorted by expert with `lax.ragged_dot` (the reference).

  Every assignment is computed (no capacity factor), so no token is ever dropped. XLA:CPU
  lowers `ragged_dot` to a dense product over all E expert blocks (E times the FLOPs, plus
  a transposed copy of every expert weight per call).
  """
  return _combine(_ragged_rows(x_ND, ids_NK, w_gate, w_up, w_down, n_experts), gates_NK)


def capacity_slots(n_assignments: int, n_experts: int, factor: float = CAPACITY_TIERS[-1],
                   max_slots: int | None = None) -> int:
  """Slots C per expert of the capacity path: `factor` x the mean load, a multiple of 8, at most
  `max_slots` (default M: no expert can hold more than every assignment)."""
  c = math.ceil(-(-n_assignments // n_experts) * factor)
  return min(-(-c // 8) * 8, n_assignments if max_slots is None else max_slots)


def capacity_tiers(n_assignments: int, n_experts: int, max_slots: int | None = None) -> tuple[int, ...]:
  """The distinct slot counts of `CAPACITY_TIERS`, ascending; one that reaches `max_slots`
  (default M) ends the list, since it holds any routing."""
  top = n_assignments if max_slots is None else max_slots
  slots = sorted({capacity_slots(n_assignments, n_experts, f, top) for f in CAPACITY_TIERS})
  return tuple(c for c in slots if c < top) + tuple(c for c in slots[-1:] if c >= top)


def _capacity_rows(x_ND, ids_NK, w_gate, w_up, w_down, n_experts: int, c: int, r=0):
  """Ungated y_NKD as `_ragged_rows` (ids == n_experts: zero rows), from an `[E, C, D]` slab.

  Exact while no expert has more than C assignments (the caller checks): assignment i
  of expert e, in (token, slot) order, sits in slot (e, i) and is computed by expert e's
  own weights; the E * C - M empty slots are zero rows (C / (M / E) x the useful FLOPs, one
  of `CAPACITY_TIERS`, instead of ragged_dot's E x on XLA:CPU). Round r > 0 (a traced
  scalar, `_slab_rounds`) slabs assignments r C .. (r + 1) C - 1 of each expert instead and
  leaves the others' rows zero.
  """
  n, k = ids_NK.shape
  m = n * k
  flat_ids_M = ids_NK.reshape(-1)
  order_M, rank_M = _sort_by_expert(flat_ids_M, n_experts + 1)  # assignments sorted by expert
  sizes_E = jnp.bincount(flat_ids_M, length=n_experts + 1)[:n_experts]
  starts_E = jnp.cumsum(sizes_E) - sizes_E
  i_C = jnp.arange(c) + r * c  # rank within the expert
  slot_EC = starts_E[:, None] + i_C[None]  # position in the sorted order
  used_EC = i_C[None] < sizes_E[:, None]
  token_EC = order_M[jnp.minimum(slot_EC, m - 1)] // k
  x_ECD = jnp.where(used_EC[..., None], x_ND[token_EC], 0).astype(x_ND.dtype)
  mm = (invariant.ordered_bmm if invariant.active() else
        lambda a, w: jnp.einsum("ecd,edf->ecf", a, w.astype(a.dtype)))
  h_ECF = jax.nn.silu(mm(x_ECD, w_gate)) * mm(x_ECD, w_up)
  y_XD = mm(h_ECF, w_down).reshape(n_experts * c, -1)  # X = E * C slots
  e_M = jnp.minimum(flat_ids_M, n_experts - 1)
  j_M = rank_M - starts_E[e_M] - r * c  # slot within this round's block of expert e
  here_M = (flat_ids_M < n_experts) & (j_M >= 0) & (j_M < c)
  slot_M = e_M * c + jnp.clip(j_M, 0, c - 1)
  return jnp.where(here_M[:, None], y_XD[slot_M], 0).reshape(n, k, -1)


def _slab_rounds(x_GnD, ids_GnK, w_gate, w_up, w_down, rounds, n_experts: int, c: int):
  """Exact y_GnKD for any routing from `rounds` rounds of the `[G, E, C, D]` slab (vmapped over G).

  `rounds` (an unbatched traced scalar: what the busiest expert of any group needs) bounds a
  while loop, forward and backward (`_rounds_vjp`), so only the rounds the routing needs run and
  memory stays one slab's plus the accumulators: a `lax.scan` over the worst-case count with a
  `lax.cond` per round would stack every round's residuals for the backward (the 30B plan's
  shard_map update: [15, 163840, 2048] per buffer), and a round the routing does not need
  would still be allocated.
  """
  return _rounds_vjp(n_experts, c, x_GnD, ids_GnK, w_gate, w_up, w_down, rounds)


def _one_round(x_GnD, ids_GnK, w_gate, w_up, w_down, r, n_experts: int, c: int):
  return jax.vmap(lambda x, ids: _capacity_rows(x, ids, w_gate, w_up, w_down, n_experts, c, r))(x_GnD, ids_GnK)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _rounds_vjp(n_experts, c, x_GnD, ids_GnK, w_gate, w_up, w_down, rounds):
  # Round 0 always runs (and gives the carry its type, shard_map's varying axes included).
  body = lambda r, y: y + _one_round(x_GnD, ids_GnK, w_gate, w_up, w_down, r, n_experts, c)
  return jax.lax.fori_loop(1, rounds, body, body(0, 0))


def _rounds_fwd(n_experts, c, x_GnD, ids_GnK, w_gate, w_up, w_down, rounds):
  y = _rounds_vjp(n_experts, c, x_GnD, ids_GnK, w_gate, w_up, w_down, rounds)
  return y, (x_GnD, ids_GnK, w_gate, w_up, w_down, rounds)


def _rounds_bwd(n_experts, c, res, dy_GnKD):
  x_GnD, ids_GnK, w_gate, w_up, w_down, rounds = res
  diff = (x_GnD, w_gate, w_up, w_down)

  def grads(r):
    f = lambda x, wg, wu, wd: _one_round(x, ids_GnK, wg, wu, wd, r, n_experts, c)
    # f32 accumulators: one add per round.
    return tuple(g.astype(jnp.promote_types(g.dtype, jnp.float32))
                 for g in jax.vjp(f, *diff)[1](dy_GnKD.astype(x_GnD.dtype)))

  body = lambda r, acc: tuple(a + g for a, g in zip(acc, grads(r)))
  dx, dwg, dwu, dwd = jax.lax.fori_loop(1, rounds, body, grads(0))
  return (dx.astype(x_GnD.dtype), None, dwg.astype(w_gate.dtype), dwu.astype(w_up.dtype),
          dwd.astype(w_down.dtype), None)


_rounds_vjp.defvjp(_rounds_fwd, _rounds_bwd)


def _capacity_experts(x_ND, ids_NK, gates_NK, w_gate, w_up, w_down, n_experts: int, c: int):
  """The experts as one batched matmul over an `[E, C, D]` slab (`_capacity_rows`), gated."""
  return _combine(_capacity_rows(x_ND, ids_NK, w_gate, w_up, w_down, n_experts, c), gates_NK)


def dropless_rows(x_GnD, ids_GnK, w_gate, w_up, w_down, n_experts: int,
                  n_assignments: int | None = None, matmul: str = "slab"):
  """Ungated y_GnKD of every (token, slot) pair of G independent token groups: no drop, ever.

  Plain weights: per group an `[E, C, D]` slab (`_capacity_rows`, vmapped over G with the
  weights unbatched) with C the smallest of `capacity_tiers` that holds the busiest expert of
  ANY group; past the last tier, `_slab_rounds` of the last tier, so memory never exceeds one
  slab's. Not `lax.ragged_dot`: XLA:CPU, and XLA:GPU outside cuDNN's bf16-output fusion, lower
  it through a dense `[rows, E * F]` buffer (the 30B plan's shard_map update: 20 GiB per layer
  for this one branch), and jax 0.10's ragged_dot has no vmap rule for an unbatched weight. The tier
  index is an unbatched scalar and the `lax.switch` stands outside the vmap: a batched index
  would make vmap run every branch. Quantized (QTensor) weights always take the ragged rows of
  all groups at once. `n_assignments` sets the tiers' mean load (default the n K rows of a
  group, which then bound C); an id equal to `n_experts` is a padding row (zero output, no load).

  `matmul` (a resolved `model.expert_matmul`): "slab" as above; "grouped" / "ragged_dot" take
  every group's rows at once through `_ragged_rows` (the Pallas grouped matmul / lax.ragged_dot,
  plain or quantized weights): the same products, no tiers.
  """
  g, n, k = ids_GnK.shape
  rows = n * k

  def ragged(x_GnD, ids_GnK, w_gate, w_up, w_down, _):
    y_NKD = _ragged_rows(x_GnD.reshape(g * n, -1), ids_GnK.reshape(g * n, k), w_gate, w_up, w_down,
                         n_experts, _ROW_IMPL[matmul])
    return y_NKD.reshape(g, n, k, -1)

  def slab(c):
    one = functools.partial(_capacity_rows, n_experts=n_experts, c=c)
    if g == 1:  # the ungrouped program as before (no size-1 batch dimension)
      return lambda x, ids, *ws_rounds: one(x[0], ids[0], *ws_rounds[:3])[None]
    return lambda x, ids, *ws_rounds: jax.vmap(one, in_axes=(0, 0, None, None, None))(
        x, ids, *ws_rounds[:3])

  if matmul != "slab" or any(isinstance(w, QTensor) for w in (w_gate, w_up, w_down)):
    return ragged(x_GnD, ids_GnK, w_gate, w_up, w_down, None)  # ops.linear.ragged_linear records it
  impl_log.record("experts", f"slab {jnp.dtype(x_GnD.dtype).name}")
  tiers = capacity_tiers(rows if n_assignments is None else n_assignments, n_experts, max_slots=rows)
  branches = [slab(c) for c in tiers]
  if tiers[-1] < rows:  # the last tier can overflow: the exact fallback follows it
    branches.append(functools.partial(_slab_rounds, n_experts=n_experts, c=tiers[-1]))
  if len(branches) == 1:
    return branches[0](x_GnD, ids_GnK, w_gate, w_up, w_down, None)
  loads_GE = jax.vmap(lambda i: jnp.bincount(i.reshape(-1), length=n_experts + 1)[:n_experts])(ids_GnK)
  load = jnp.max(loads_GE)  # busiest expert over every group: one scalar for the whole batch
  index = jnp.sum(load > jnp.asarray(tiers, load.dtype))  # tiers too small for it
  rounds = -(-load // tiers[-1])  # rounds of the last tier's slab that hold it
  return jax.lax.switch(index, branches, x_GnD, ids_GnK, w_gate, w_up, w_down, rounds)
