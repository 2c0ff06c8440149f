"""Device mesh `(data, fsdp, expert, tensor)` from config and the one table of partition rules."""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from rl_jax.config_utils import ConfigError, require

MESH_AXES = ("data", "fsdp", "expert", "tensor")
# Batch dimensions are split over every axis that does not split the model's features.
BATCH_AXES = ("data", "fsdp", "expert")

# Logical parameter axis -> mesh axis. The only place partitioning is decided:
# FSDP shards the model dimension, tensor parallel the heads / MLP / vocab
# dimensions, expert parallel the expert dimension.
LOGICAL_RULES: dict[str | None, str | None] = {
    "embed": "fsdp",
    "vocab": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "expert": "expert",
    # The leading axis of scanned (stacked) layer parameters: every device holds every
    # layer's shard, since the scan walks the layers in sequence.
    "layers": None,
    None: None,
}


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Mesh axis sizes; one axis may be -1 to take all remaining devices.

  `num_devices` > 0 builds the mesh over only the first that many devices (0 = all).
  `sampler_devices` > 0 (with `rl.mode='async'`) gives the sampler that many of them, the same
  share of every process's devices, and the trainer the rest; both meshes take these axis sizes,
  the -1 axis absorbing each group's count (`split_meshes`). 0: both share every device.
  """
  data: int = 1
  fsdp: int = -1
  expert: int = 1
  tensor: int = 1
  num_devices: int = 0
  sampler_devices: int = 0

  def __post_init__(self):
    sizes = [self.data, self.fsdp, self.expert, self.tensor]
    require(sum(s == -1 for s in sizes) <= 1, "mesh", "at most one axis may be -1")
    for name, s in zip(MESH_AXES, sizes):
      require(s == -1 or s >= 1, f"mesh.{name}", f"must be >= 1 or -1, got {s}")
    require(self.num_devices >= 0, "mesh.num_devices", f"must be >= 0, got {self.num_devices}")
    require(self.sampler_devices >= 0, "mesh.sampler_devices", f"must be >= 0, got {self.sampler_devices}")

  def resolve(self, n_devices: int) -> tuple[int, ...]:
    sizes = [self.data, self.fsdp, self.expert, self.tensor]
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
      if n_devices % known:
        raise ConfigError(f"config key 'mesh': {n_devices} devices not divisible by fixed axes {known}")
      sizes[sizes.index(-1)] = n_devices // known
    if math.prod(sizes) != n_devices:
      raise ConfigError(f"config key 'mesh': axis sizes {dict(zip(MESH_AXES, sizes))} "
                        f"need {math.prod(sizes)} devices, have {n_devices}")
    return tuple(sizes)


def make_mesh(cfg: MeshConfig | None = None, devices=None) -> Mesh:
  """A 4-axis mesh over `devices` (default: all devices of all processes)."""
  cfg = cfg or MeshConfig()
  devices = list(jax.devices() if devices is None else devices)
  if cfg.num_devices:
    if cfg.num_devices > len(devices):
      raise ConfigError(f"config key 'mesh.num_devices': {cfg.num_devices} > {len(devices)} available devices")
    devices = devices[:cfg.num_devices]
  shape = cfg.resolve(len(devices))
  return Mesh(np.asarray(devices).reshape(shape), MESH_AXES)


def split_meshes(cfg: MeshConfig, devices=None) -> tuple[Mesh, Mesh]:
  """(trainer mesh, sampler mesh) of `cfg.sampler_devices` (0: one mesh for both).

  Each process gives the sampler the first `sampler_devices / process_count` of its own devices,
  so both groups span every process and every host reads its rows of either group's arrays.
  """
  devices = list(jax.devices() if devices is None else devices)
  if cfg.num_devices:
    devices = devices[:cfg.num_devices]
  if not cfg.sampler_devices:
    mesh = make_mesh(dataclasses.replace(cfg, num_devices=0), devices)
    return mesh, mesh
  procs = sorted({d.process_index for d in devices})
  n = cfg.sampler_devices
  if n % len(procs) or n >= len(devices):
    raise ConfigError(f"config key 'mesh.sampler_devices': {n} must be fewer than the {len(devices)} "
                      f"devices and a multiple of the {len(procs)} processes")
  per = n // len(procs)
  sampler = [d for p in procs for d in [d for d in devices if d.process_index == p][:per]]
  trainer = [d for d in devices if d not in sampler]
  base = dataclasses.replace(cfg, num_devices=0, sampler_devices=0)
  try:
    sampler_mesh = make_mesh(base, sampler)
  except ConfigError as e:
    raise ConfigError(f"config key 'mesh.sampler_devices': the sampler's {n} devices do not take the "
                      f"mesh's axis sizes ({e})") from None
  return make_mesh(base, trainer), sampler_mesh


def on_mesh(tree: Any, mesh: Mesh, shardings: Any = None) -> Any:
  """`tree`'s arrays moved to `mesh` (a device-to-device copy), with the same partition specs or
  with `shardings` (a matching pytree).

  Multi-controller JAX reshards across device sets only on TPU; elsewhere each process gathers
  the arrays on the host and places its own shards (a host round trip: fine for rollouts and
  small models, a cost to plan for large ones on several GPU hosts).
  """
  if shardings is None:
    shardings = jax.tree.map(lambda x: NamedSharding(mesh, x.sharding.spec if isinstance(
        getattr(x, "sharding", None), NamedSharding) else P()), tree)
  if jax.process_count() == 1 or jax.devices()[0].platform == "tpu":
    return jax.device_put(tree, shardings)
  # The gather is a jit: it runs under the arrays' own mesh, whatever the context mesh is.
  with mesh_context(jax.tree.leaves(tree)[0].sharding.mesh):
    host = to_host(tree)
  return jax.tree.map(lambda x, s: jax.make_array_from_callback(x.shape, s, lambda idx: x[idx]), host, shardings)


def _is_var(x) -> bool:
  return isinstance(x, nnx.Variable)


def logical_to_spec(axes, shape, mesh: Mesh) -> P:
  """PartitionSpec for a parameter; a dimension not divisible by its mesh axis stays replicated."""
  if axes is None:
    return P()
  out = []
  for name, dim in zip(axes, shape):
    mesh_axis = LOGICAL_RULES.get(name)
    if mesh_axis is not None and dim % mesh.shape[mesh_axis] != 0:
      mesh_axis = None
    out.append(mesh_axis)
  return P(*out)


def state_shardings(state: Any, mesh: Mesh) -> Any:
  """NamedSharding per variable of an `nnx.State` (a pytree prefix of the state)."""
  def one(v):
    if _is_var(v):
      axes = v.get_metadata().get("axes")
      value = v.get_value() if hasattr(v, "get_value") else v.value
      sharding = NamedSharding(mesh, logical_to_spec(axes, getattr(value, "shape", ()), mesh))
      # A quantized tensor lays out packed values and scales itself (see quant.QTensor).
      return value.shardings(sharding) if hasattr(value, "shardings") else sharding
    return NamedSharding(mesh, P())
  return jax.tree.map(one, state, is_leaf=_is_var)


def shard_state(state: Any, mesh: Mesh) -> Any:
  return jax.device_put(state, state_shardings(state, mesh))


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
  """Leading dimension split over the batch axes, the rest replicated."""
  return NamedSharding(mesh, P(BATCH_AXES, *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def shard_batch(batch: Any, mesh: Mesh) -> Any:
  """Puts every array of `batch` with its leading (batch) dimension split over the batch axes."""
  return jax.tree.map(lambda x: jax.device_put(x, batch_sharding(mesh, np.ndim(x))) if np.ndim(x)
                      else jax.device_put(x, replicated(mesh)), batch)


def batch_divisor(mesh: Mesh) -> int:
  """Batch sizes must be multiples of this to split evenly over the batch axes."""
  return math.prod(mesh.shape[a] for a in BATCH_AXES)


def param_shardings(state: Any, mesh: Mesh) -> dict:
  """`state_shardings` as a pure nested dict, matching `nnx.to_pure_dict(state)`."""
  return nnx.to_pure_dict(state_shardings(state, mesh))


def host_to_global(batch: Any, mesh: Mesh) -> Any:
  """Global arrays split over the batch axes from the full host batch every process holds.

  Each process builds the same (deterministic) full batch; every device then takes its
  own rows. This works unchanged on one process and on many (multi-host).
  """
  def one(x):
    x = np.asarray(x)
    sharding = batch_sharding(mesh, x.ndim) if x.ndim else replicated(mesh)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])
  return jax.tree.map(one, batch)


def to_host(x: Any) -> Any:
  """The full value of a (possibly multi-host sharded) array as numpy, on every process."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    return jax.tree.map(np.asarray, multihost_utils.process_allgather(x, tiled=True))
  return jax.tree.map(np.asarray, jax.device_get(x))


def mesh_context(mesh: Mesh):
  """`jax.set_mesh(mesh)`: jobs run their whole loop inside it. The model's traced code reads the
  context mesh for the shard_map MoE dispatch (models/expert_parallel.py) and for the batch
  constraint on the residual stream (`transformer.constrain_batch`), without which GSPMD lets
  the fsdp-split weights replicate the activations' batch on every device."""
  return jax.set_mesh(mesh)
