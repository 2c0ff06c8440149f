"""Expert-parallel MoE dispatch under `shard_map` (all-gather + reduce-scatter, dropless) and its byte cost."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from rl_jax.config_utils import ConfigError
from rl_jax.quant.ops import ragged_linear
from rl_jax.quant.qtensor import QTensor

# Mesh axes (rl_jax/sharding.py names; repeated, not imported, so the model stays importable
# without the sharding module's dependencies). Tokens are split over the batch axes, experts
# over EXPERT_AXIS and each expert's hidden dimension over TENSOR_AXIS.
EXPERT_AXIS = "expert"
TENSOR_AXIS = "tensor"
BATCH_AXES = ("data", "fsdp", "expert")

DISPATCHES = ("gspmd", "shard_map")


def context_mesh():
  """The mesh set by `jax.set_mesh(mesh)` around the traced call, or a ConfigError."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or EXPERT_AXIS not in mesh.axis_names:
    raise ConfigError(
        "config key 'model.moe_dispatch'='shard_map' needs the device mesh in context: call the "
        "model under `jax.set_mesh(mesh)` with a mesh that has an 'expert' axis (rl_jax.sharding."
        f"make_mesh); found axes {tuple(mesh.axis_names) if not mesh.empty else ()}")
  return mesh


def _weight_spec(w, spec: P):
  """in_spec for a weight; a QTensor shards its values and scales along the same leading axes."""
  if isinstance(w, QTensor):
    # Packed values / per-block scales change the last two dims' sizes, so only the expert axis
    # is split (the tensor axis is not used for quantized experts, see `shard_map_experts`).
    return jax.tree.map(lambda _: P(spec[0]), w)
  return spec


def shard_map_experts(x_ND, ids_NK, gates_NK, w_gate, w_up, w_down, n_experts: int, mesh=None):
  """Dropless SwiGLU experts with explicit expert-parallel communication; equals `dropless_experts`.

  Communication is ALL-GATHER + REDUCE-SCATTER over the mesh's `expert` axis, not all-to-all:
  XLA:CPU does not implement `ragged-all-to-all` (jax 0.10: "HLO opcode `ragged-all-to-all` is
  not supported by XLA:CPU ThunkEmitter"), so a token-to-owner ragged all-to-all could not be
  tested here. Each device all-gathers the tokens (and their expert ids and gates) of its
  `expert`-axis group, runs `lax.ragged_dot` over its local experts for the (token, slot) pairs
  routed to them, and a `psum_scatter` returns each token's summed expert outputs to its owner.
  It is dropless by construction: every device sees every assignment, so no buffer can overflow
  whatever the routing skew (no capacity factor). Bytes per device and layer are in
  `dispatch_comm_bytes`: about 2 (ep - 1) n D activation bytes, against about 2 k (ep - 1)/ep n D
  for a balanced all-to-all (n = local tokens, k = top-k); the gather wins when k > ep, loses
  otherwise, and unlike all-to-all its cost does not depend on the routing. Memory: each device
  holds the gathered ep n tokens and ep n k expert-sorted rows (the buffer a dropless all-to-all
  would also need for the worst-case skew); `ragged_dot` gets only the local groups' rows.

  Expert hidden dims (F) split over the `tensor` axis are summed with a `psum` over it; quantized
  (QTensor) experts are split over `expert` only. Tokens are split over the batch axes when their
  count divides, otherwise replicated (then a `psum` over `expert` replaces the scatter).
  `mesh` defaults to the context mesh (`jax.set_mesh`).
  """
  mesh = context_mesh() if mesh is None else mesh
  ep = mesh.shape[EXPERT_AXIS]
  if n_experts % ep:
    raise ConfigError(f"config key 'model.moe_dispatch'='shard_map': n_experts={n_experts} is not "
                      f"divisible by the mesh's expert axis ({ep})")
  n_local = n_experts // ep
  n, k = ids_NK.shape
  batch_axes = tuple(a for a in BATCH_AXES if a in mesh.axis_names)
  split_tokens = n % math.prod(mesh.shape[a] for a in batch_axes) == 0
  tok_spec = P(batch_axes, None) if split_tokens else P(None, None)
  quantized = any(isinstance(w, QTensor) for w in (w_gate, w_up, w_down))
  moe_d_ff = w_gate.shape[-1]
  tp = mesh.shape.get(TENSOR_AXIS, 1)
  tensor = TENSOR_AXIS if (tp > 1 and not quantized and moe_d_ff % tp == 0) else None
  in_specs = (tok_spec, tok_spec, tok_spec,
              _weight_spec(w_gate, P(EXPERT_AXIS, None, tensor)),
              _weight_spec(w_up, P(EXPERT_AXIS, None, tensor)),
              _weight_spec(w_down, P(EXPERT_AXIS, tensor, None)))

  def body(x_nD, ids_nK, gates_nK, wg, wu, wd):
    if split_tokens and ep > 1:
      # Every token of this expert-axis group, so each device sees all pairs routed to its experts.
      x_GD = jax.lax.all_gather(x_nD, EXPERT_AXIS, axis=0, tiled=True)
      ids_GK = jax.lax.all_gather(ids_nK, EXPERT_AXIS, axis=0, tiled=True)
      gates_GK = jax.lax.all_gather(gates_nK, EXPERT_AXIS, axis=0, tiled=True)
    else:
      x_GD, ids_GK, gates_GK = x_nD, ids_nK, gates_nK
    g = x_GD.shape[0]
    local_GK = ids_GK - jax.lax.axis_index(EXPERT_AXIS) * n_local
    mine_GK = (local_GK >= 0) & (local_GK < n_local)
    # Pairs for other devices' experts sort last (key n_local) and lie outside every group.
    key_M = jnp.where(mine_GK, local_GK, n_local).reshape(-1)
    order_M = jnp.argsort(key_M, stable=True)
    group_sizes_e = jnp.bincount(key_M, length=n_local + 1)[:n_local].astype(jnp.int32)
    x_MD = x_GD[order_M // k]
    # A QTensor's logical shape is read off its (now local) children: no fix-up needed.
    h_MF = jax.nn.silu(ragged_linear(x_MD, wg, group_sizes_e)) * ragged_linear(x_MD, wu, group_sizes_e)
    y_MD = ragged_linear(h_MF, wd, group_sizes_e)
    # Rows past the local groups are not defined by ragged_dot's contract: zero them explicitly.
    y_MD = jnp.where(jnp.sort(key_M)[:, None] < n_local, y_MD, 0)
    y_GKD = jnp.zeros_like(y_MD).at[order_M].set(y_MD).reshape(g, k, -1)
    # Other devices' pairs are zero rows here, so only local experts add to this partial sum.
    y_GD = jnp.einsum("gkd,gk->gd", y_GKD, gates_GK.astype(y_GKD.dtype))
    if split_tokens and ep > 1:
      y_nD = jax.lax.psum_scatter(y_GD, EXPERT_AXIS, scatter_dimension=0, tiled=True)
    else:
      y_nD = jax.lax.psum(y_GD, EXPERT_AXIS)
    if tensor is not None:
      y_nD = jax.lax.psum(y_nD, TENSOR_AXIS)
    return y_nD

  fn = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=tok_spec)
  return fn(x_ND, ids_NK, gates_NK, w_gate, w_up, w_down)


def dispatch_comm_bytes(dispatch: str, *, tokens: int, d_model: int, n_experts: int, top_k: int,
                        expert_axis: int, batch_shards: int | None = None,
                        act_bytes: int = 2) -> dict[str, float]:
  """Per-device bytes RECEIVED by one MoE layer's forward dispatch (the backward moves the same).

  `tokens` is the tokens each device owns (global tokens / `batch_shards`, the product of the
  batch axes data x fsdp x expert; default `expert_axis`), `expert_axis` the mesh's expert-axis
  size (ep), `act_bytes` the activation dtype's size. Ring collectives: an all-gather or
  reduce-scatter over p devices brings (p - 1) / p of the full array into each device, an
  all-reduce twice that.

  - "shard_map" (this module): all-gather of tokens (D act_bytes), ids (4 B x k) and gates
    (4 B x k), reduce-scatter of the outputs (D act_bytes): (ep - 1) n (2 D b + 8 k).
    Independent of routing skew.
  - "gspmd": read off the compiled HLO (jax 0.10, XLA:CPU, fsdp=2 x expert=4): the SPMD
    partitioner does not split `ragged_dot`'s rows by expert; it all-reduces the expert-sorted
    (token, slot) rows of the WHOLE batch, N_global k rows of D, over all batch shards, so every
    device holds and receives them: 2 (P - 1)/P N_global k D b. Only this dominant term is
    modelled (smaller all-reduces of [N_global k, F] partial sums are left out); the compiled
    program decides, so take the planner's HLO figures as the measurement.
  Both also report, for comparison, a dropless ragged all-to-all (each (token, slot) pair sent
  to its expert's device and back, with its 4-byte id): "all_to_all_balanced" under uniform
  routing, and "all_to_all_skewed" for the device holding the one expert every token picks.
  """
  if dispatch not in DISPATCHES:
    raise ConfigError(f"config key 'model.moe_dispatch': {dispatch!r} is not one of {list(DISPATCHES)}")
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
  if dispatch == "shard_map":
    out["all_gather"] = (ep - 1) * n * (pair + 8 * k)
    out["reduce_scatter"] = (ep - 1) * n * pair
    out["total"] = out["all_gather"] + out["reduce_scatter"]
  else:
    out["rows_all_reduce"] = 2 * (shards - 1) / shards * n * shards * k * pair
    out["total"] = out["rows_all_reduce"]
  return out
