"""Multi-process start-up: jax.distributed.initialize from RL_JAX_* variables, or SLURM / TPU detection."""
from __future__ import annotations

import os
from typing import Mapping

import jax

ENV_COORDINATOR = "RL_JAX_COORDINATOR"      # host:port of process 0's coordination service
ENV_NUM_PROCESSES = "RL_JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "RL_JAX_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "RL_JAX_LOCAL_DEVICE_IDS"  # optional, e.g. "0,1" (one process per GPU subset)
ENV_MODE = "RL_JAX_DISTRIBUTED"             # 'auto': let JAX detect SLURM / TPU pod / MPI / k8s
ENV_TIMEOUT = "RL_JAX_INIT_TIMEOUT"         # seconds to wait for every process to join

_EXPLICIT = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)
_OFF = ("", "0", "off", "none", "false")


def _int(env: Mapping[str, str], key: str) -> int:
  try:
    return int(env[key])
  except ValueError:
    raise ValueError(f"environment variable {key}={env[key]!r} is not an integer") from None


def maybe_initialize(environ: Mapping[str, str] | None = None) -> bool:
  """Joins a multi-process JAX job if the environment asks for one; returns whether it did.

  - `RL_JAX_COORDINATOR` / `RL_JAX_NUM_PROCESSES` / `RL_JAX_PROCESS_ID` all set: explicit
    initialization (what launch/local_multiprocess.sh and launch/slurm_gpu.sbatch export).
    Setting only some of them is an error, naming the missing ones, rather than a silent
    single-process run that would train on 1/N of the devices.
  - `RL_JAX_DISTRIBUTED=auto`: `jax.distributed.initialize()` with no arguments, which
    detects SLURM (srun), Cloud TPU pods, Open MPI and Kubernetes jobs.
  - otherwise: a no-op (single process).

  Must run before anything touches a JAX backend (`jax.devices()`, any array), which is why
  `rl_jax.main` calls it first. Calling it again after a successful initialization is a no-op.
  """
  env = os.environ if environ is None else environ
  if jax.distributed.is_initialized():
    return True
  timeout = _int(env, ENV_TIMEOUT) if env.get(ENV_TIMEOUT) else 300
  present = [k for k in _EXPLICIT if env.get(k)]
  if present:
    missing = [k for k in _EXPLICIT if k not in present]
    if missing:
      raise ValueError(f"multi-process start: {present} are set but {missing} are not; set all three "
                       f"of {list(_EXPLICIT)} (or none, or {ENV_MODE}=auto)")
    num, pid = _int(env, ENV_NUM_PROCESSES), _int(env, ENV_PROCESS_ID)
    if not 0 <= pid < num:
      raise ValueError(f"{ENV_PROCESS_ID}={pid} is not in [0, {ENV_NUM_PROCESSES}={num})")
    local = env.get(ENV_LOCAL_DEVICE_IDS)
    jax.distributed.initialize(
        coordinator_address=env[ENV_COORDINATOR], num_processes=num, process_id=pid,
        local_device_ids=[int(i) for i in local.split(",")] if local else None,
        initialization_timeout=timeout)
    return True
  mode = env.get(ENV_MODE, "").strip().lower()
  if mode == "auto":
    jax.distributed.initialize(initialization_timeout=timeout)
    return True
  if mode not in _OFF:
    raise ValueError(f"{ENV_MODE}={env[ENV_MODE]!r} is not one of ['auto', '' (off)]")
  return False


def check_global_sum() -> float:
  """Smoke test of a multi-process set-up: every process contributes its rows of one global array.

  Process p holds rows [p*L, (p+1)*L) of arange(P*L) (L = its local device count), the array is
  assembled with `make_array_from_process_local_data` over all devices, and a jitted sum must
  equal the closed form on every process. Raises AssertionError otherwise.
  """
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  n_local, n_global = jax.local_device_count(), jax.device_count()
  mesh = Mesh(np.asarray(jax.devices()), ("x",))
  start = jax.process_index() * n_local
  local = np.arange(start, start + n_local, dtype=np.float32)[:, None] * np.ones((1, 4), np.float32)
  arr = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), local, (n_global, 4))
  total = jax.jit(lambda x: x.sum(), out_shardings=NamedSharding(mesh, P()))(arr)
  got, want = float(total), 4.0 * n_global * (n_global - 1) / 2
  assert got == want, f"process {jax.process_index()}: global sum {got} != {want}"
  return got


def main() -> None:
  """`python -m rl_jax.distributed`: join the job described by the environment and check a global sum."""
  joined = maybe_initialize()
  total = check_global_sum()
  print(f"[rl_jax.distributed] process {jax.process_index()}/{jax.process_count()} joined={joined} "
        f"devices local={jax.local_device_count()} global={jax.device_count()} global_sum={total} OK",
        flush=True)


if __name__ == "__main__":
  main()
