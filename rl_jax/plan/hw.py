"""Accelerator table (peak bf16 FLOP/s, HBM bandwidth and capacity), roofline time and the fit check."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Accelerator:
  name: str
  peak_flops: float      # dense bf16 FLOP/s per chip
  hbm_bw: float          # HBM bytes/s per chip
  hbm_bytes: float       # HBM capacity per chip
  link_bw: float = 0.0   # collective bytes/s one chip receives within a host / slice (0: not modelled)
  net_bw: float = 0.0    # the same across hosts (a GPU's NIC); TPU slices stay on the ICI
  per_host: int = 8      # chips per host


# Sources: NVIDIA H100 Tensor Core GPU datasheet (SXM5: 989 TFLOP/s dense bf16, 3.35 TB/s,
# 80 GB, NVLink 900 GB/s bidirectional = 450 GB/s each way); NVIDIA H200 datasheet (SXM: 989
# TFLOP/s dense bf16, 4.8 TB/s, 141 GB, NVLink 900 GB/s); one 400 Gb/s NDR InfiniBand NIC per GPU
# (50 GB/s each way) between hosts, the DGX H100 / HGX H200 layout; Google Cloud TPU v5p system
# architecture page (459 TFLOP/s bf16, 2,765 GB/s, 95 GB HBM2e, ICI 4,800 Gbps = 600 GB/s per chip).
DEVICES: dict[str, Accelerator] = {
    "h100": Accelerator("H100 SXM 80GB", 989e12, 3.35e12, 80e9, link_bw=450e9, net_bw=50e9),
    "h200": Accelerator("H200 SXM 141GB", 989e12, 4.8e12, 141e9, link_bw=450e9, net_bw=50e9),
    "tpu_v5p": Accelerator("TPU v5p", 459e12, 2.76e12, 95e9, link_bw=600e9, net_bw=600e9, per_host=4),
}
# Usable share of a chip's memory: what the launch scripts let XLA take (XLA_PYTHON_CLIENT_MEM_FRACTION
# in launch/slurm_gpu.sbatch); the rest is the CUDA context, NCCL buffers and fragmentation.
MEM_FRACTION = 0.9


def comm_bw(acc: Accelerator, n_devices: int) -> float:
  """Per-chip collective bandwidth for a mesh of `n_devices`: the intra-host links when the mesh fits
  one host, else (conservatively: every collective is taken to cross hosts) the network's."""
  return acc.link_bw if n_devices <= acc.per_host else acc.net_bw


def roofline_s(flops: float, bytes_accessed: float, acc: Accelerator, comm_bytes: float = 0.0,
               n_devices: int = 1) -> float:
  """Lower bound on a program's time: compute-bound or memory-bound, whichever is slower, plus the
  collectives at `comm_bw` (not overlapped: a bound on a program whose collectives all wait)."""
  bw = comm_bw(acc, n_devices)
  comm = comm_bytes / bw if comm_bytes and bw else 0.0
  return max(flops / acc.peak_flops, bytes_accessed / acc.hbm_bw) + comm


class DoesNotFit(RuntimeError):
  """A program's per-device peak exceeds the accelerator's memory."""


def check_fit(program: str, contributors: dict[str, int], acc: Accelerator,
              mem_fraction: float = MEM_FRACTION) -> int:
  """Sum of `contributors` (per-device bytes live at the program's peak) against the usable
  `mem_fraction` x `acc.hbm_bytes`.

  Returns the total; raises DoesNotFit naming the largest contributors when it is larger.
  """
  total = sum(contributors.values())
  usable = mem_fraction * acc.hbm_bytes
  if total > usable:
    top = sorted(contributors.items(), key=lambda kv: -kv[1])[:4]
    parts = ", ".join(f"{k} {gib(v)}" for k, v in top if v > 0)
    raise DoesNotFit(f"program '{program}' needs {gib(total)} per device > {mem_fraction:g} x {acc.name}'s "
                     f"{gib(acc.hbm_bytes)} = {gib(usable)}; largest: {parts}")
  return total


def gib(n: float) -> str:
  """Bytes in GiB, or in MiB / KiB / B when smaller (a tiny model's figures stay readable)."""
  for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if abs(n) >= size:
      return f"{n / size:.2f} {unit}"
  return f"{int(n)} B"
