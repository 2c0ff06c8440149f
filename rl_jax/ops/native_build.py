"""Builds the native XLA FFI handlers (`ops/native/*.cc`) into a per-user cache on first use."""
from __future__ import annotations

import glob
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile

import jax

# Headers every handler may include (`#include "parallel_for.h"`); part of each library's key.
INCLUDE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native")
ENV_CACHE = "RL_JAX_NATIVE_CACHE"


def cache_dir() -> str:
  return os.environ.get(ENV_CACHE) or os.path.join(
      os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "rl_jax", "native")


def _flags() -> list[str]:
  # x86-64: AVX2 + FMA where the CPU has them (8 floats a vector instead of SSE's 4, a*b+c fused); the library
  # is keyed by the machine's flags, so hosts that share a home never load one built for another.
  if platform.machine() in ("x86_64", "AMD64") and {"avx2", "fma"} <= _cpu_flags():
    return ["-mavx2", "-mfma", "-ffp-contract=fast"]
  return []


def _cpu_flags() -> set[str]:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("flags"):
          return set(line.split(":", 1)[1].split())
  except OSError:
    pass
  return set()


def library_path(source: str) -> str:
  """The cached library of `source`: keyed by the source and the headers beside it, jax's version
  and FFI headers' path, the Python ABI and the compiler flags."""
  text = b""
  for name in [source] + sorted(glob.glob(os.path.join(INCLUDE_DIR, "*.h"))):
    with open(name, "rb") as f:
      text += f.read()
  digest = hashlib.sha256(text + jax.ffi.include_dir().encode() + jax.__version__.encode()
                          + sys.implementation.cache_tag.encode() + " ".join(_flags()).encode()).hexdigest()[:16]
  stem = os.path.splitext(os.path.basename(source))[0]
  return os.path.join(cache_dir(), f"{stem}_{digest}.so")


def build(source: str, path: str | None = None, what: str = "a native handler") -> str:
  """Compiles `source` to `path` (default: `library_path(source)`) unless it is there; returns the path.

  Raises RuntimeError naming the compiler's output when the build fails. Written under a temporary
  name and renamed, so processes that build at once (test workers, hosts sharing a home) never
  load a half-written library."""
  path = path or library_path(source)
  if os.path.exists(path):
    return path
  cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
  if not cxx:
    raise RuntimeError(f"no C++ compiler (g++, c++, clang++ or $CXX) to build {what}")
  os.makedirs(os.path.dirname(path), exist_ok=True)
  fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
  os.close(fd)
  cmd = [cxx, "-O3", "-std=c++17", "-shared", "-fPIC", "-w", *_flags(), f"-I{INCLUDE_DIR}", f"-I{jax.ffi.include_dir()}", source, "-o", tmp]
  proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
  if proc.returncode:
    os.unlink(tmp)
    raise RuntimeError(f"building {what} failed ({' '.join(cmd)}):\n{proc.stderr[-2000:]}")
  os.replace(tmp, path)
  return path


def register(source: str, symbol: str, target: str, *, what: str, fallback: str, env_disable: str,
             batch_partitionable: bool = False) -> bool:
  """Builds `source` and registers its handler `symbol` as the CPU FFI target `target`; True when
  it serves. False when `env_disable` is set to 0, and False with one warning (naming `what` and
  the `fallback` that serves instead) when it cannot be built or registered: no build or
  registration may stop a run. `batch_partitionable`: the partitioner may keep every axis but the
  last sharded instead of gathering the operands to each device (independent rows)."""
  if os.environ.get(env_disable, "1") == "0":
    return False
  try:
    import ctypes  # pylint: disable=g-import-not-at-top
    lib = ctypes.cdll.LoadLibrary(build(source, what=what))
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    if batch_partitionable:
      jax.ffi.register_ffi_target_as_batch_partitionable(target)
  except Exception as e:  # pylint: disable=broad-except
    logging.getLogger(__name__).warning("%s unavailable, %s: %s", what, fallback, e)
    return False
  return True
