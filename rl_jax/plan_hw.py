"""Accelerator table (peak bf16 FLOP/s, HBM bandwidth and capacity), roofline time and the fit check."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Accelerator:
  name: str
  peak_flops: float      # dense bf16 FLOP/s per chip
  hbm_bw: float          # HBM bytes/s per chip
  hbm_bytes: float       # HBM capacity per chip


# Sources: NVIDIA H100 Tensor Core GPU datasheet (SXM5: 989 TFLOP/s dense bf16, 3.35 TB/s,
# 80 GB); NVIDIA H200 datasheet (SXM: 989 TFLOP/s dense bf16, 4.8 TB/s, 141 GB); Google Cloud
# TPU v5p system architecture page (459 TFLOP/s bf16, 2,765 GB/s, 95 GB HBM2e per chip).
DEVICES: dict[str, Accelerator] = {
    "h100": Accelerator("H100 SXM 80GB", 989e12, 3.35e12, 80e9),
    "h200": Accelerator("H200 SXM 141GB", 989e12, 4.8e12, 141e9),
    "tpu_v5p": Accelerator("TPU v5p", 459e12, 2.76e12, 95e9),
}


def roofline_s(flops: float, bytes_accessed: float, acc: Accelerator) -> float:
  """Lower bound on a program's time: compute-bound or memory-bound, whichever is slower."""
  return max(flops / acc.peak_flops, bytes_accessed / acc.hbm_bw)


class DoesNotFit(RuntimeError):
  """A program's per-device peak exceeds the accelerator's memory."""


def check_fit(program: str, contributors: dict[str, int], acc: Accelerator) -> int:
  """Sum of `contributors` (per-device bytes live at the program's peak) against `acc.hbm_bytes`.

  Returns the total; raises DoesNotFit naming the largest contributors when it is larger.
  """
  total = sum(contributors.values())
  if total > acc.hbm_bytes:
    top = sorted(contributors.items(), key=lambda kv: -kv[1])[:4]
    parts = ", ".join(f"{k} {gib(v)}" for k, v in top if v > 0)
    raise DoesNotFit(f"program '{program}' needs {gib(total)} per device > {acc.name}'s {gib(acc.hbm_bytes)}; "
                     f"largest: {parts}")
  return total


def gib(n: float) -> str:
  """Bytes in GiB, or in MiB / KiB / B when smaller (a tiny model's figures stay readable)."""
  for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if abs(n) >= size:
      return f"{n / size:.2f} {unit}"
  return f"{int(n)} B"
