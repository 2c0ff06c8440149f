"""Expert-parallel MoE dispatch under `shard_map`: capped all-to-all (exact fallback) or all-gather; its bytes.

Two explicit dispatches (`ModelConfig.moe_dispatch`), both dropless and equal to
`moe.dropless_experts` (the single-device reference) in values and gradients:

- "shard_map": ALL-TO-ALL. Each device sends each expert-axis peer only the (token, slot) rows
  routed to that peer's local experts, in a per-peer buffer of `a2a_capacity` rows
  (`A2A_CAPACITY_FACTOR` x the balanced load n k / ep, rounded up to 8), the peer runs its
  local experts on what it received (`expert_rows.dropless_rows`: capacity slab tiers, then rounds
  of the last one; or, by `ModelConfig.expert_matmul`, the Pallas grouped matmul or ragged_dot of the sorted rows),
  a second all-to-all brings the results back and the owner combines them with its gates (gates
  never travel). When any buffer of the expert-axis group would overflow (skewed routing), the
  whole group (a `pmax` of the flag over `expert`) takes an exact fallback under a `lax.cond`,
  counted (`all_to_all_experts`' second output): by default "rounds", the same padded
  all-to-all repeated until the busiest peer's rows have all travelled (memory of one round,
  traffic growing with the skew), or "all_gather", the dispatch below (traffic independent of
  the skew; but a `lax.cond` allocates for its larger branch, so the gather's rows then set
  the layer's peak memory whether or not it runs: 8 devices, 1,024 tokens each, D 512, 64
  experts, top-8, bf16: forward + backward temporaries 4.66 GiB with it, 1.61 GiB with rounds,
  4.89 GiB for the all-gather dispatch alone).
  Two collectives implement it (`ModelConfig.moe_a2a`): "padded", `lax.all_to_all` of the
  fixed-size buffers (the reference; XLA:CPU runs it), and "ragged", `lax.ragged_all_to_all`
  of only the routed rows into a receive buffer of the same ep x cap rows (overflow: a peer
  would receive more than that in total). XLA:CPU does not compile ragged-all-to-all
  ("HLO opcode `ragged-all-to-all` is not supported by XLA:CPU ThunkEmitter", jax 0.10), so it is
  only lowered here; its offset logic is tested on CPU with `ragged_all_to_all_reference`.
  jax 0.10's primitive has a JVP and a transpose rule (the reverse ragged all-to-all of the
  cotangent), so it is differentiable.
- "all_gather": ALL-GATHER + REDUCE-SCATTER. Each device all-gathers the tokens (and ids and
  gates) of its expert-axis group, runs its local experts on the pairs routed to them, and a
  `psum_scatter` returns each token's summed expert outputs to its owner. Dropless by
  construction (every device sees every assignment) and independent of routing skew, but it
  holds ep n tokens and ep n k expert-sorted rows per device (10.5 M rows at the 30B pod config).

Bytes received per device and layer (`dispatch_comm_bytes`; n local tokens, k top-k, D model
width, b activation bytes): all-gather (ep - 1) n (2 D b + 8 k); padded all-to-all
(ep - 1) cap (2 D b + 4) with cap = 2 n k / ep, about 4 k (ep - 1)/ep n D b; ragged all-to-all
2 k (ep - 1)/ep n D b under balanced routing. So the gather moves fewer bytes than the padded
buffers when ep < 2 k (the 30B pod config, ep 8 and top-8: half of them; as many as the ragged
all-to-all), the all-to-all fewer when ep > 2 k; in memory the all-to-all always wins: its
buffers are 2 x 2 n k rows against the gather's ep n tokens and ep n k expert-sorted rows.

Expert hidden dims (F) split over the `tensor` axis are summed with a `psum` over it; quantized
(QTensor) experts are split over `expert` only. Tokens are split over the batch axes when their
count divides, otherwise replicated: then every device already holds every token and the
all-gather dispatch (a `psum` over `expert` in place of the scatter) runs for both.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from rl_jax.config_utils import ConfigError
from rl_jax.models import expert_rows
from rl_jax.ops.linear import ragged_linear
from rl_jax.quant.qtensor import QTensor

# Mesh axes (rl_jax/sharding.py names; repeated, not imported, so the model stays importable
# without the sharding module's dependencies). Tokens are split over the batch axes, experts
# over EXPERT_AXIS and each expert's hidden dimension over TENSOR_AXIS.
EXPERT_AXIS = "expert"
TENSOR_AXIS = "tensor"
BATCH_AXES = ("data", "fsdp", "expert")

DISPATCHES = ("gspmd", "shard_map", "all_gather")
A2A_IMPLS = ("padded", "ragged")
# Per-peer all-to-all buffer rows as a multiple of the balanced load n k / ep. 2x holds a peer
# receiving twice its share from every device; the random-init routing of issue 15's MoE
# (max / mean expert load 1.11-1.49) fits, and a buffer is never larger than n k (all rows).
A2A_CAPACITY_FACTOR = 2.0


def context_mesh(dispatch: str = "shard_map"):
  """The mesh set by `jax.set_mesh(mesh)` around the traced call, or a ConfigError."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or EXPERT_AXIS not in mesh.axis_names:
    raise ConfigError(
        f"config key 'model.moe_dispatch'={dispatch!r} needs the device mesh in context: call the "
        "model under `jax.set_mesh(mesh)` with a mesh that has an 'expert' axis (rl_jax.sharding."
        f"make_mesh); found axes {tuple(mesh.axis_names) if not mesh.empty else ()}")
  return mesh


def _weight_spec(w, spec: P):
  """in_spec for a weight; a QTensor shards its values and scales along the same leading axes."""
  if isinstance(w, QTensor):
    # Packed values / per-block scales change the last two dims' sizes, so only the expert axis
    # is split (the tensor axis is not used for quantized experts, see `_layout`).
    return jax.tree.map(lambda _: P(spec[0]), w)
  return spec


@dataclasses.dataclass(frozen=True)
class _Layout:
  """How one dispatch call is split over the mesh."""
  ep: int                       # expert-axis size
  n_local: int                  # experts per expert-axis device
  batch_axes: tuple[str, ...]   # the mesh's batch axes (tokens split over them when `split`)
  split: bool                   # tokens split over the batch axes (else replicated)
  tok_spec: P
  tensor: str | None            # TENSOR_AXIS when the experts' F is split over it
  w_specs: tuple
  matmul: str = "slab"          # the local experts' resolved `model.expert_matmul` (models/moe.py)


def _layout(mesh, n_experts: int, n_tokens: int, w_gate, w_up, w_down, dispatch: str,
            matmul: str = "slab") -> _Layout:
  ep = mesh.shape[EXPERT_AXIS]
  if n_experts % ep:
    raise ConfigError(f"config key 'model.moe_dispatch'={dispatch!r}: n_experts={n_experts} is not "
                      f"divisible by the mesh's expert axis ({ep})")
  batch_axes = tuple(a for a in BATCH_AXES if a in mesh.axis_names)
  split = n_tokens % math.prod(mesh.shape[a] for a in batch_axes) == 0
  quantized = any(isinstance(w, QTensor) for w in (w_gate, w_up, w_down))
  tp = mesh.shape.get(TENSOR_AXIS, 1)
  tensor = TENSOR_AXIS if (tp > 1 and not quantized and w_gate.shape[-1] % tp == 0) else None
  w_specs = (_weight_spec(w_gate, P(EXPERT_AXIS, None, tensor)),
             _weight_spec(w_up, P(EXPERT_AXIS, None, tensor)),
             _weight_spec(w_down, P(EXPERT_AXIS, tensor, None)))
  return _Layout(ep, n_experts // ep, batch_axes, split,
                 P(batch_axes, None) if split else P(None, None), tensor, w_specs, matmul)


def _check_vma(lay: _Layout) -> bool:
  """shard_map's varying-axes check, off around the Pallas grouped matmul: jax 0.10's pallas_call
  wants each output's varying axes declared, and its interpret mode (CPU) slices varying refs
  with unvarying grid indices, which the check rejects. Off, the transpose still sums a
  replicated input's cotangent over the axes it is replicated on."""
  return lay.matmul != "grouped"


def _varying(lay: _Layout, ws):
  """The expert weights marked varying over every batch axis, before any per-device branch.

  A weight replicated over a batch axis (`data`, say) gets its cotangent summed over that axis by
  the transpose, at the point where it first meets per-device values. Left to JAX, that is inside
  whichever `lax.switch` / `lax.cond` branch a device takes (the capacity tier of its load, the
  overflow fallback), so devices on different branches wait in different all-reduces: a deadlock
  (XLA:CPU aborts after its rendezvous timeout; NCCL would hang). Cast here, the sum runs once, at
  the top of the body, on every device. (With the check off, shard_map sums at its boundary;
  with tokens not split over the batch axes every device takes the same branches.)
  """
  if not _check_vma(lay) or not lay.split:
    return ws

  def one(w):
    aval = jax.typeof(w)
    # jax 0.10 keeps the varying axes in `manual_axis_type.varying`; later versions in `vma`.
    mat = getattr(aval, "manual_axis_type", None)
    varying = mat.varying if mat is not None else aval.vma
    missing = tuple(a for a in lay.batch_axes if a not in varying)
    if not missing:
      return w
    if hasattr(jax.lax, "pcast"):
      return jax.lax.pcast(w, missing, to="varying")
    return jax.lax.pvary(w, missing)
  return jax.tree.map(one, ws)


def _gather_body(lay: _Layout, x_nD, ids_nK, gates_nK, wg, wu, wd):
  """All-gather dispatch of one device's tokens: y_nD, before the tensor-axis psum."""
  k = ids_nK.shape[1]
  gather = lay.split and lay.ep > 1
  if gather:
    # Every token of this expert-axis group, so each device sees all pairs routed to its experts.
    x_GD = jax.lax.all_gather(x_nD, EXPERT_AXIS, axis=0, tiled=True)
    ids_GK = jax.lax.all_gather(ids_nK, EXPERT_AXIS, axis=0, tiled=True)
    gates_GK = jax.lax.all_gather(gates_nK, EXPERT_AXIS, axis=0, tiled=True)
  else:
    x_GD, ids_GK, gates_GK = x_nD, ids_nK, gates_nK
  g = x_GD.shape[0]
  local_GK = ids_GK - jax.lax.axis_index(EXPERT_AXIS) * lay.n_local
  mine_GK = (local_GK >= 0) & (local_GK < lay.n_local)
  # Pairs for other devices' experts sort last (key n_local) and lie outside every group.
  key_M = jnp.where(mine_GK, local_GK, lay.n_local).reshape(-1)
  order_M = jnp.argsort(key_M, stable=True)
  group_sizes_e = jnp.bincount(key_M, length=lay.n_local + 1)[:lay.n_local].astype(jnp.int32)
  x_MD = x_GD[order_M // k]
  # A QTensor's logical shape is read off its (now local) children: no fix-up needed. Only
  # expert_matmul "grouped" changes the product: this dispatch had no slab, so "slab" keeps ragged_dot.
  impl = "pallas" if lay.matmul == "grouped" else "ragged_dot"
  h_MF = (jax.nn.silu(ragged_linear(x_MD, wg, group_sizes_e, impl))
          * ragged_linear(x_MD, wu, group_sizes_e, impl))
  y_MD = ragged_linear(h_MF, wd, group_sizes_e, impl)
  # Rows past the local groups are not defined by ragged_dot's contract: zero them explicitly.
  y_MD = jnp.where(jnp.sort(key_M)[:, None] < lay.n_local, y_MD, 0)
  y_GKD = jnp.zeros_like(y_MD).at[order_M].set(y_MD).reshape(g, k, -1)
  # Other devices' pairs are zero rows here, so only local experts add to this partial sum.
  y_GD = jnp.einsum("gkd,gk->gd", y_GKD, gates_GK.astype(y_GKD.dtype))
  if gather:
    return jax.lax.psum_scatter(y_GD, EXPERT_AXIS, scatter_dimension=0, tiled=True)
  return jax.lax.psum(y_GD, EXPERT_AXIS)


def _tensor_sum(lay: _Layout, y_nD):
  return y_nD if lay.tensor is None else jax.lax.psum(y_nD, TENSOR_AXIS)


def all_gather_experts(x_ND, ids_NK, gates_NK, w_gate, w_up, w_down, n_experts: int, mesh=None, *,
                       expert_matmul: str = "slab"):
  """Dropless SwiGLU experts, all-gather + reduce-scatter over `expert` (module docstring).

  Equals `moe.dropless_experts`; the exact fallback of `all_to_all_experts`. `mesh` defaults to
  the context mesh (`jax.set_mesh`). `expert_matmul` (resolved: slab, ragged_dot, grouped): the
  local experts' grouped product, ragged_dot unless "grouped" (the Pallas grouped matmul).
  """
  mesh = context_mesh("all_gather") if mesh is None else mesh
  lay = _layout(mesh, n_experts, x_ND.shape[0], w_gate, w_up, w_down, "all_gather", expert_matmul)

  def body(x_nD, ids_nK, gates_nK, *ws):
    return _tensor_sum(lay, _gather_body(lay, x_nD, ids_nK, gates_nK, *_varying(lay, ws)))

  fn = jax.shard_map(body, mesh=mesh, in_specs=(lay.tok_spec,) * 3 + lay.w_specs,
                     out_specs=lay.tok_spec, check_vma=_check_vma(lay))
  return fn(x_ND, ids_NK, gates_NK, w_gate, w_up, w_down)


def a2a_capacity(n_assignments: int, expert_axis: int, factor: float = A2A_CAPACITY_FACTOR) -> int:
  """Rows of each per-peer all-to-all buffer: `factor` x the balanced load M / ep, a multiple of
  8, at most M (a buffer of M rows holds any routing: then no fallback is needed)."""
  c = math.ceil(-(-n_assignments // expert_axis) * factor)
  return min(-(-c // 8) * 8, n_assignments)


def ragged_all_to_all_reference(operand, output, input_offsets, send_sizes, output_offsets,
                                recv_sizes, *, axis_name):
  """`lax.ragged_all_to_all`'s documented semantics from a padded `lax.all_to_all` (any backend).

  Slice p (rows input_offsets[p] : + send_sizes[p] of `operand`) goes to axis index p, where it
  is written at output_offsets[p]; the other rows of `output` are kept. Each slice travels in a
  buffer of all N operand rows, so it moves ep x the bytes: a test reference, not a dispatch.
  """
  n = operand.shape[0]
  i_N = jnp.arange(n)
  src_PN = jnp.minimum(input_offsets[:, None] + i_N[None], n - 1)
  live_PN = i_N[None] < send_sizes[:, None]
  tail = (1,) * (operand.ndim - 1)
  chunks = jnp.where(live_PN.reshape(live_PN.shape + tail), operand[src_PN], 0)
  recv = jax.lax.all_to_all(chunks, axis_name, 0, 0, tiled=True)  # [ep, N, ...]: by source
  offsets_Q = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
  dst_QN = jnp.where(i_N[None] < recv_sizes[:, None], offsets_Q[:, None] + i_N[None], output.shape[0])
  rows = recv.reshape((-1,) + operand.shape[1:]).astype(output.dtype)
  return output.at[dst_QN.reshape(-1)].set(rows, mode="drop")


# Indirection so a CPU test can swap in `ragged_all_to_all_reference` (XLA:CPU cannot compile the primitive).
_ragged_all_to_all = jax.lax.ragged_all_to_all


def _send_plan(ids_nK, n_local: int, ep: int):
  """The (token, slot) pairs sorted by expert (so by destination peer, then local expert):
  (order_M, rank_M its inverse, peer_M, sizes_P pairs per peer, starts_P their sorted offsets)."""
  flat_M = ids_nK.reshape(-1)
  m = flat_M.shape[0]
  order_M = jnp.argsort(flat_M, stable=True)
  rank_M = jnp.zeros_like(order_M).at[order_M].set(jnp.arange(m, dtype=order_M.dtype))
  peer_M = flat_M // n_local
  sizes_P = jnp.bincount(peer_M, length=ep).astype(jnp.int32)
  starts_P = (jnp.cumsum(sizes_P) - sizes_P).astype(jnp.int32)
  return order_M, rank_M, peer_M, sizes_P, starts_P


def _local_experts(lay: _Layout, x_RD, e_R, ws, n_assignments: int):
  """Ungated SwiGLU of received rows by local expert e_R (n_local = padding row: zero)."""
  return expert_rows.dropless_rows(x_RD[None], e_R[None, :, None], *ws, lay.n_local,
                               n_assignments=n_assignments, matmul=lay.matmul)[0, :, 0]


def _padded_round(lay: _Layout, cap: int, r, x_nD, ids_nK, gates_nK, *ws):
  """Round r of the padded all-to-all: each peer's sorted pairs r cap .. (r + 1) cap - 1 travel
  (round 0 is the whole dispatch when no buffer overflows); returns their gated y_nD share."""
  n, k = ids_nK.shape
  m = n * k
  order_M, rank_M, peer_M, sizes_P, starts_P = _send_plan(ids_nK, lay.n_local, lay.ep)
  # Buffer row p * cap + j holds peer p's (r cap + j)-th pair (sorted order), or padding.
  p_R = jnp.arange(lay.ep * cap) // cap
  j_R = jnp.arange(lay.ep * cap) % cap + r * cap
  used_R = j_R < sizes_P[p_R]
  pair_R = order_M[jnp.minimum(starts_P[p_R] + j_R, m - 1)]
  x_send_RD = jnp.where(used_R[:, None], x_nD[pair_R // k], 0).astype(x_nD.dtype)
  e_send_R = jnp.where(used_R, ids_nK.reshape(-1)[pair_R] % lay.n_local, lay.n_local).astype(jnp.int32)
  a2a = lambda a: jax.lax.all_to_all(a, EXPERT_AXIS, 0, 0, tiled=True)
  # Received: cap rows from each peer in turn, each block sorted by local expert.
  y_RD = _local_experts(lay, a2a(x_send_RD), a2a(e_send_R), ws, m)
  y_back_RD = a2a(y_RD)  # block p: peer p's results for the rows sent to it, in the same order
  j_M = rank_M - starts_P[peer_M]  # each pair's rank among its peer's pairs
  slot_M = peer_M * cap + jnp.clip(j_M - r * cap, 0, cap - 1)
  y_MD = jnp.where(((j_M >= r * cap) & (j_M < (r + 1) * cap))[:, None], y_back_RD[slot_M], 0)
  y_nKD = y_MD.reshape(n, k, -1)
  return jnp.einsum("nkd,nk->nd", y_nKD, gates_nK.astype(y_nKD.dtype))


def _padded_a2a_body(lay: _Layout, cap: int, x_nD, ids_nK, gates_nK, *ws):
  """Padded all-to-all dispatch of one device's tokens (no buffer overflows: the caller checks)."""
  return _padded_round(lay, cap, 0, x_nD, ids_nK, gates_nK, *ws)


def _rounds_body(lay: _Layout, cap: int, rounds, x_nD, ids_nK, gates_nK, *ws):
  """Exact padded all-to-all in `rounds` (agreed over `expert`) rounds of the same buffers.

  A `lax.scan` over the ceil(M / cap) rounds the worst routing needs, each skipped by a
  `lax.cond` past `rounds`, so memory stays one round's (rounds are rematerialized in the
  backward: their residuals would otherwise stack) while the traffic grows with the skew.
  """
  n_rounds = -(-ids_nK.size // cap)
  one = jax.checkpoint(lambda r: _padded_round(lay, cap, r, x_nD, ids_nK, gates_nK, *ws))

  def step(y_nD, r):
    y_nD = y_nD + jax.lax.cond(r < rounds, one, lambda r: jnp.zeros_like(y_nD), r)
    return y_nD, None

  # Round 0 always runs (an overflow needs at least two), then rounds 1 .. n_rounds - 1 as needed.
  return jax.lax.scan(step, one(0), jnp.arange(1, n_rounds))[0]


def _ragged_offsets(sizes_P, recv_rows: int):
  """From every device's per-peer sizes: this device's ragged_all_to_all offsets and the overflow
  flag (a device would receive more than `recv_rows`); identical flag on every expert-axis peer."""
  sizes_QP = jax.lax.all_gather(sizes_P, EXPERT_AXIS, axis=0, tiled=False)  # [source, destination]
  me = jax.lax.axis_index(EXPERT_AXIS)
  before_QP = jnp.cumsum(sizes_QP, axis=0) - sizes_QP  # rows sources q' < q send to p
  recv_sizes_Q = sizes_QP[:, me]
  recv_starts_Q = jnp.cumsum(recv_sizes_Q) - recv_sizes_Q  # where source q's rows land here
  out_offsets_P = before_QP[me]  # where my slice for p lands in p's receive buffer
  # Where the results for source q land back on q: q's sorted offset of its pairs for me.
  back_offsets_Q = (jnp.cumsum(sizes_QP, axis=1) - sizes_QP)[:, me]
  overflow = jnp.any(jnp.sum(sizes_QP, axis=0) > recv_rows)
  return recv_sizes_Q, recv_starts_Q, out_offsets_P, back_offsets_Q, overflow


def _ragged_a2a_body(lay: _Layout, cap: int, x_nD, ids_nK, gates_nK, *ws):
  """Ragged all-to-all dispatch: only routed rows move, into ep x cap receive rows per device."""
  n, k = ids_nK.shape
  m = n * k
  recv_rows = lay.ep * cap
  order_M, rank_M, _, sizes_P, starts_P = _send_plan(ids_nK, lay.n_local, lay.ep)
  recv_sizes_Q, recv_starts_Q, out_offsets_P, back_offsets_Q, _ = _ragged_offsets(sizes_P, recv_rows)
  x_MD = x_nD[order_M // k]
  e_M1 = (ids_nK.reshape(-1)[order_M] % lay.n_local).astype(jnp.int32)[:, None]
  send = lambda a, out: _ragged_all_to_all(a, out, starts_P, sizes_P, out_offsets_P, recv_sizes_Q,
                                           axis_name=EXPERT_AXIS)
  x_RD = send(x_MD, jnp.zeros((recv_rows, x_nD.shape[1]), x_nD.dtype))
  e_R = send(e_M1, jnp.full((recv_rows, 1), lay.n_local, jnp.int32))[:, 0]
  y_RD = _local_experts(lay, x_RD, e_R, ws, m)
  y_MD = _ragged_all_to_all(y_RD, jnp.zeros((m, y_RD.shape[1]), y_RD.dtype), recv_starts_Q,
                            recv_sizes_Q, back_offsets_Q, sizes_P, axis_name=EXPERT_AXIS)
  y_nKD = y_MD[rank_M].reshape(n, k, -1)
  return jnp.einsum("nkd,nk->nd", y_nKD, gates_nK.astype(y_nKD.dtype))


FALLBACKS = ("rounds", "all_gather")


def all_to_all_experts(x_ND, ids_NK, gates_NK, w_gate, w_up, w_down, n_experts: int, mesh=None, *,
                       impl: str = "padded", capacity_factor: float = A2A_CAPACITY_FACTOR,
                       fallback: str = "rounds", expert_matmul: str = "slab"):
  """Dropless SwiGLU experts by a capped all-to-all over `expert` (module docstring).

  Returns (y_ND, fallback_fraction): y_ND equals `moe.dropless_experts`; the float32 scalar is
  the fraction of token shards whose expert-axis group overflowed a buffer and took the exact
  fallback (`lax.cond` on the flag, agreed over the group by a `pmax`), 1.0 when every group
  did. `impl` "padded" (lax.all_to_all) or "ragged" (lax.ragged_all_to_all; not on XLA:CPU).
  `fallback` "rounds" (`_rounds_body`: the padded all-to-all again, as many rounds of the same
  buffers as the busiest peer needs: memory stays the all-to-all's) or "all_gather"
  (`all_gather_experts`' body: skew-independent traffic, but a `lax.cond` allocates for its
  larger branch, so the gather's ep n k rows set the layer's peak memory anyway).
  `mesh` defaults to the context mesh (`jax.set_mesh`). `expert_matmul` (resolved: slab,
  ragged_dot, grouped) is how the local experts run on the received rows (`expert_rows.dropless_rows`).
  """
  if impl not in A2A_IMPLS:
    raise ConfigError(f"config key 'model.moe_a2a': {impl!r} is not one of {list(A2A_IMPLS)}")
  if fallback not in FALLBACKS:
    raise ValueError(f"all_to_all_experts: fallback={fallback!r} is not one of {FALLBACKS}")
  mesh = context_mesh("shard_map") if mesh is None else mesh
  lay = _layout(mesh, n_experts, x_ND.shape[0], w_gate, w_up, w_down, "shard_map", expert_matmul)
  n_shards = math.prod(mesh.shape[a] for a in lay.batch_axes)
  k = ids_NK.shape[1]
  m = x_ND.shape[0] // n_shards * k  # (token, slot) pairs per device
  cap = a2a_capacity(m, lay.ep, capacity_factor)
  if not lay.split or lay.ep == 1 or cap >= m:
    # Every device holds every token (replicated) or one device all experts: nothing to route.
    # A buffer of all m rows can never overflow, but the all-to-all would move ep x m rows where
    # the gather moves ep x n tokens: take the gather.
    y_ND = all_gather_experts(x_ND, ids_NK, gates_NK, w_gate, w_up, w_down, n_experts, mesh,
                              expert_matmul=expert_matmul)
    return y_ND, jnp.zeros((), jnp.float32)

  a2a_body = _padded_a2a_body if impl == "padded" else _ragged_a2a_body

  def body(x_nD, ids_nK, gates_nK, *ws):
    ws = _varying(lay, ws)
    sizes_P = jnp.bincount(ids_nK.reshape(-1) // lay.n_local, length=lay.ep)  # pairs per peer
    # Rounds of cap rows the busiest (device, peer) pair needs: > 1 overflows the padded buffers.
    rounds = jax.lax.pmax(-(-jnp.max(sizes_P) // cap), EXPERT_AXIS)
    if impl == "padded":
      over = rounds > 1
    else:  # every peer sees the same gathered sizes: the flag agrees without a pmax
      over = _ragged_offsets(sizes_P, lay.ep * cap)[-1]
    exact = ((lambda *a: _rounds_body(lay, cap, rounds, *a)) if fallback == "rounds"
             else (lambda *a: _gather_body(lay, *a)))
    y_nD = jax.lax.cond(over, exact, lambda *a: a2a_body(lay, cap, *a), x_nD, ids_nK, gates_nK, *ws)
    return _tensor_sum(lay, y_nD), over.astype(jnp.float32)[None]

  fn = jax.shard_map(body, mesh=mesh, in_specs=(lay.tok_spec,) * 3 + lay.w_specs,
                     out_specs=(lay.tok_spec, P(lay.batch_axes)), check_vma=_check_vma(lay))
  y_ND, over_S = fn(x_ND, ids_NK, gates_NK, w_gate, w_up, w_down)
  return y_ND, jnp.mean(over_S)


def dispatch_comm_bytes(dispatch: str, *, tokens: int, d_model: int, n_experts: int, top_k: int,
                        expert_axis: int, batch_shards: int | None = None, act_bytes: int = 2,
                        a2a: str = "padded",
                        capacity_factor: float = A2A_CAPACITY_FACTOR) -> dict[str, float]:
  """Per-device bytes RECEIVED by one MoE layer's forward dispatch (the backward moves the same).

  `tokens` is the tokens each device owns (global tokens / `batch_shards`, the product of the
  batch axes data x fsdp x expert; default `expert_axis`), `expert_axis` the mesh's expert-axis
  size (ep), `act_bytes` the activation dtype's size. Linear in `tokens` (the planner scales a
  one-token figure). Ring collectives: an all-gather or reduce-scatter over p devices brings
  (p - 1) / p of the full array into each device, an all-reduce twice that; an all-to-all brings
  the (p - 1) blocks of the other devices.

  - "shard_map" (`all_to_all_experts`, no overflow): "padded" receives, from each of the ep - 1
    peers, its cap-row buffer of activations (D b) and local expert ids (4 B), and the cap rows
    of results back: (ep - 1) cap (2 D b + 4), cap = min(factor / ep, 1) n k (the rounding of
    cap up to 8 rows left out). "ragged" receives only the routed rows, balanced:
    (ep - 1)/ep n k (2 D b + 4) (its ep x ep sizes all-gather, 4 ep^2 B, left out). A layer
    that overflows moves instead, with the "rounds" fallback, the padded figure once per round
    (ceil(busiest peer's rows / cap), at most ep / factor), or with the "all_gather" one
    "fallback_all_gather", that dispatch's total. When cap reaches n k (ep <= factor) the
    dispatch is the all-gather's.
  - "all_gather" (`all_gather_experts`): all-gather of tokens (D b), ids (4 B x k) and gates
    (4 B x k), reduce-scatter of the outputs (D b): (ep - 1) n (2 D b + 8 k). Independent of
    routing skew.
  - "gspmd": read off the compiled HLO (jax 0.10, XLA:CPU, fsdp=2 x expert=4) of the UNGROUPED
    dispatch (`moe.dropless_experts` with groups=1): the SPMD partitioner does not split
    `ragged_dot`'s rows by expert; it all-reduces the expert-sorted (token, slot) rows of the
    WHOLE batch, N_global k rows of D, over all batch shards, so every device holds and
    receives them: 2 (P - 1)/P N_global k D b (smaller all-reduces left out). The model's
    GSPMD dispatch is GROUPED whenever a mesh's batch axes divide the tokens (`batch_groups`):
    no token rows move ("grouped_total" 0); the partitioner all-gathers every expert weight to
    each batch shard instead, 3 E D F parameter bytes x (P_w - 1)/P_w per layer and pass
    (P_w the weights' shards), independent of the tokens and so not in this per-token model:
    take the planner's HLO figures for it.
  All also report, for comparison, an ideal dropless ragged all-to-all (ids sent, no results'
  ids): "all_to_all_balanced" under uniform routing, and "all_to_all_skewed" for the device
  holding the one expert every token picks.
  """
  if dispatch not in DISPATCHES:
    raise ConfigError(f"config key 'model.moe_dispatch': {dispatch!r} is not one of {list(DISPATCHES)}")
  if a2a not in A2A_IMPLS:
    raise ConfigError(f"config key 'model.moe_a2a': {a2a!r} is not one of {list(A2A_IMPLS)}")
  ep, n, d, k = expert_axis, tokens, d_model, top_k
  shards = ep if batch_shards is None else batch_shards
  if n_experts % ep or shards % ep:
    raise ConfigError(f"n_experts={n_experts} and batch_shards={shards} must be divisible by the "
                      f"expert axis ({ep})")
  pair = d * act_bytes
  out = {
      "all_to_all_balanced": 2 * n * k * (ep - 1) / ep * pair + n * k * (ep - 1) / ep * 4,
      # The hot device receives every other device's pairs (and returns them: sent, not received).
      "all_to_all_skewed": (ep - 1) * n * k * (pair + 4),
  }
  gather = {"all_gather": (ep - 1) * n * (pair + 8 * k), "reduce_scatter": (ep - 1) * n * pair}
  gather["total"] = gather["all_gather"] + gather["reduce_scatter"]
  if dispatch == "all_gather" or (dispatch == "shard_map" and capacity_factor >= ep):
    out.update(gather)
  elif dispatch == "shard_map":
    if a2a == "padded":
      out["all_to_all"] = (ep - 1) * (capacity_factor / ep) * n * k * (2 * pair + 4)
    else:
      out["all_to_all"] = (ep - 1) / ep * n * k * (2 * pair + 4)
    out["fallback_all_gather"] = gather["total"]
    out["total"] = out["all_to_all"]
  else:
    out["rows_all_reduce"] = 2 * (shards - 1) / shards * n * shards * k * pair
    out["total"] = out["rows_all_reduce"]
    out["grouped_total"] = 0.0
  return out
