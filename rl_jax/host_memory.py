"""Host allocator for XLA:CPU runs: freed buffers are reused, not page-faulted back in at every step."""
from __future__ import annotations

import importlib.util
import os
import platform
import sys
import sysconfig
from typing import Mapping

# Why: XLA:CPU allocates an executable's temporaries afresh at every call, and glibc serves
# blocks above its mmap threshold (32 MiB at most) with a fresh mmap that it unmaps on free,
# so every step touches ~1 GiB of new pages. Issue 15's train step (2 cores, update of
# 32 x 160 tokens): dense 1.17 GiB of minor page faults and 0.53 s of kernel time per 1.28 s
# step, MoE 1.86 GiB / 0.85 s per 1.75 s. An allocator that keeps freed pages mapped ends the
# faults: tcmalloc 1.05 s / 1.30 s, jemalloc without page decay 1.08 s / 1.29 s. glibc's own
# knobs are no substitute (no mmap + no trim + one arena: dense 1.07 s but MoE 2.11 s).
# (Measured with resource.getrusage around 5 steady steps of `bench_train_peers.Ours.step`.)
#
# Each entry: (library file names, the variables that make it keep freed pages), in order of
# preference. mimalloc comes from a wheel (`cmeel-mimalloc`, a dependency of rl_jax on x86-64
# Linux), so a pip install alone gets a fast allocator, no apt; the system ones still serve where
# the wheel does not exist (aarch64).
ALLOCATORS = (
    (("libmimalloc.so",), {"MIMALLOC_PURGE_DELAY": "-1"}),
    (("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"), {"TCMALLOC_RELEASE_RATE": "0"}),
    (("libjemalloc.so.2",), {"MALLOC_CONF": "dirty_decay_ms:-1,muzzy_decay_ms:-1"}),
)
LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
            "/usr/local/lib")
# Where cmeel wheels put their shared libraries: <site-packages>/cmeel.prefix/lib.
WHEEL_LIB_DIRS = tuple(dict.fromkeys(
    os.path.join(sysconfig.get_paths()[k], "cmeel.prefix", "lib") for k in ("purelib", "platlib")))
ALLOCATOR_TAGS = ("mimalloc", "tcmalloc", "jemalloc")
# RL_JAX_HOST_MALLOC: unset / "auto" picks a library above; "0" leaves the process alone; a path
# names the library to preload. The re-executed process sees "on".
SWITCH = "RL_JAX_HOST_MALLOC"
HINT = ("rl_jax: XLA:CPU re-faults its temporaries at every step under glibc malloc (~20% of a train "
        "step here); pip install cmeel-mimalloc, or a system tcmalloc / jemalloc (Debian/Ubuntu: apt "
        f"install libtcmalloc-minimal4), and rl_jax's entry points preload it ({SWITCH}=0 silences this)")
_ACCELERATOR_PLUGINS = ("libtpu", "jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin",
                        "jax_rocm7_plugin")


def _runs_on_cpu(environ: Mapping[str, str]) -> bool:
  """Whether JAX will compute on XLA:CPU, decided without importing jax.

  `JAX_PLATFORMS` decides when set; otherwise an installed accelerator plugin means the
  process will use it (there device memory is XLA's own, and host pages kept mapped would
  only cost resident memory).
  """
  platforms = environ.get("JAX_PLATFORMS", "").strip()
  if platforms:
    return platforms.split(",")[0].strip() == "cpu"
  return not any(importlib.util.find_spec(m) is not None for m in _ACCELERATOR_PLUGINS)


def find_allocator(choice: str = "auto") -> tuple[str, dict[str, str]] | None:
  """(library path, its variables) for `choice` ("auto" or a library path), or None if none is found."""
  if choice not in ("", "auto"):
    if not os.path.isfile(choice):
      raise FileNotFoundError(f"{SWITCH}={choice!r}: no such file (a mimalloc, tcmalloc or jemalloc "
                              ".so, 'auto' or '0')")
    name = os.path.basename(choice)
    env = next((e for names, e in ALLOCATORS if any(name.startswith(n.split(".so")[0]) for n in names)), {})
    return choice, dict(env)
  for names, env in ALLOCATORS:
    for d in WHEEL_LIB_DIRS + LIB_DIRS:
      for n in names:
        path = os.path.join(d, n)
        if os.path.isfile(path):
          return path, dict(env)
  return None


def tuned_env(environ: Mapping[str, str]) -> dict[str, str] | None:
  """The environment to re-execute with (allocator preloaded), or None when there is nothing to do.

  Nothing to do: switched off (`RL_JAX_HOST_MALLOC=0`), already re-executed, not Linux with
  glibc, not an XLA:CPU run, the library already preloaded, or none installed (then `HINT`
  goes to stderr). Variables the caller set win over the allocator's defaults.
  """
  choice = environ.get(SWITCH, "auto").strip()
  if choice in ("0", "on"):
    return None
  if sys.platform != "linux" or platform.libc_ver()[0] != "glibc" or not _runs_on_cpu(environ):
    return None
  found = find_allocator(choice)
  if found is None:
    print(HINT, file=sys.stderr)
    return None
  path, lib_env = found
  preload = environ.get("LD_PRELOAD", "")
  if os.path.basename(path) in preload:
    return None
  return {**lib_env, **environ, "LD_PRELOAD": f"{path}:{preload}" if preload else path, SWITCH: "on"}


def reexec_tuned() -> None:
  """Re-executes this process (same interpreter, same command line) with `tuned_env`.

  Call it first thing in a command-line entry point, before jax is imported: the loader
  reads LD_PRELOAD only at process start. Returns without doing anything when `tuned_env`
  says so, and in the re-executed process.
  """
  env = tuned_env(os.environ)
  if env is None:
    return
  sys.stdout.flush()
  sys.stderr.flush()
  os.execve(sys.executable, list(sys.orig_argv), env)


def describe(environ: Mapping[str, str] = os.environ) -> str:
  """The allocator this process runs with, for benchmark headers: a preloaded library or glibc's malloc."""
  for lib in environ.get("LD_PRELOAD", "").split(":"):
    if any(k in os.path.basename(lib) for k in ALLOCATOR_TAGS):
      return os.path.basename(lib)
  return "glibc malloc"
