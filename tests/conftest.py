"""Test setup: CPU JAX with 8 simulated devices, so sharded == unsharded tests run anywhere."""
import atexit
import os
import shutil
import tempfile

import pytest

# Must be set before jax is imported anywhere in the test session.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
# Two compile settings for the suite's programs, each with its own switch. Compiling is most of a
# test's time here (a 2-step trainer run: 78 s of its 91 s in XLA's backend compile), and the
# programs are tiny; IEEE arithmetic either way (XLA:CPU does not enable fast-math), and what a test
# compares is two programs of this codebase, or this codebase against transformers at float32 tolerance.
# - LLVM at -O0 (XLA's HLO passes, fusion included, still run): halves the compile. Measured on 2
#   cores: tests/test_rl_trainer.py 430 s CPU -> 209 s with the cache below. RL_JAX_TEST_XLA_OPT=default
#   keeps LLVM's default level.
# - XLA:CPU's classic elemental emitters instead of its MLIR fusion emitters: the R2/R3 trainer test's
#   update (value_and_grad, ~12.7k HLO lines) compiles in 8.0 s instead of 16.0 s, the whole suite in
#   19 min instead of 30.5 (2 loaded cores, 2026-12-07). Those emitters may round a value XLA
#   recomputes in two fusions 1-5 ulp apart, so a claim of bit equality *between* programs (or
#   between two fusions of one) is checked at the default emitters: the tests in USER_CODEGEN below
#   rerun in a subprocess with RL_JAX_TEST_XLA_EMITTERS=default, the setting users' programs get.
#   Only where XLA has them: jaxlib 0.10's does; 0.12's has only the fusion emitters, and an unknown
#   flag in XLA_FLAGS aborts the process (the 3.12 smoke subset of .ci/run runs there).
TEST_XLA_FLAGS = {"RL_JAX_TEST_XLA_OPT": "--xla_backend_optimization_level=0",
                  "RL_JAX_TEST_XLA_EMITTERS": "--xla_cpu_use_fusion_emitters=false"}


def _jaxlib_version() -> tuple[int, ...]:
  from importlib import metadata  # pylint: disable=g-import-not-at-top
  try:
    return tuple(int(x) for x in metadata.version("jaxlib").split(".")[:2])
  except (metadata.PackageNotFoundError, ValueError):
    return (0, 0)


if _jaxlib_version() >= (0, 11):
  os.environ["RL_JAX_TEST_XLA_EMITTERS"] = "default"   # no classic emitters to choose
for _switch, _flag in TEST_XLA_FLAGS.items():
  if os.environ.get(_switch, "") != "default" and _flag.split("=")[0] not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " " + _flag


def user_codegen_env(*switches: str) -> dict:
  """This process's environment with the named TEST_XLA_FLAGS switches back at XLA's defaults (all
  of them when none is named), for a subprocess that checks a claim where users' programs run."""
  switches = switches or tuple(TEST_XLA_FLAGS)
  drop = {TEST_XLA_FLAGS[s] for s in switches}
  env = {**os.environ, **{s: "default" for s in switches}}
  env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if f not in drop)
  return env


# XLA's persistent compilation cache, one fresh directory per test session: the pytest-xdist controller
# imports this file first and creates it, and the workers (and the subprocesses a test starts) inherit
# the variable, so they share it (checked: gw0 and gw1 print the same directory). The suite compiles
# the same programs many times over (every trainer run builds new jitted closures; each module ends
# with jax.clear_caches() below), and a cache hit skips XLA's backend compile. Measured on 2 cores:
# tests/test_rl_trainer.py 420 s -> 341 s cold. Two workers may write one entry at once (jax writes
# a missing entry without a lock); a read of a half-written entry fails to decompress, and jax then
# warns and compiles. Deleted when the controller exits. Set JAX_COMPILATION_CACHE_DIR yourself to
# keep one across runs.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _XLA_CACHE = tempfile.mkdtemp(prefix="rl_jax_test_xla_cache_")
  atexit.register(shutil.rmtree, _XLA_CACHE, ignore_errors=True)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _XLA_CACHE
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("WANDB_SILENT", "true")


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
  """Drops jax's compiled programs after each test module. One process compiles thousands of
  XLA:CPU executables over the suite, each holding memory mappings of its JIT code; kept alive,
  they neared the kernel's vm.max_map_count (65,530) and an XLA compile late in the suite aborted
  the whole process (SIGABRT in tests/test_scan_quant.py, a file that passes on its own)."""
  yield
  import gc  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  jax.clear_caches()
  gc.collect()


@pytest.fixture(scope="module")
def fast_compile():
  """Skips XLA's backend optimizations for a module of tiny programs, where compiling costs
  more than running (numerics are IEEE either way)."""
  import jax  # pylint: disable=g-import-not-at-top
  old = jax.config.read("jax_disable_most_optimizations")
  jax.config.update("jax_disable_most_optimizations", True)
  yield
  jax.config.update("jax_disable_most_optimizations", old)


def need(module: str):
  """An optional test dependency (the `hf` extra: torch, transformers; nbclient / nbformat):
  skipped where it is not installed, but under CI (`CI=true`, where `.ci/run` installs every
  extra) a missing one fails instead of silently skipping its tests."""
  import importlib  # pylint: disable=g-import-not-at-top
  if os.environ.get("CI", "").lower() == "true":
    return importlib.import_module(module)
  return pytest.importorskip(module)


def ragged_prompts(vocab: int, width: int, lengths=(3, 8, 5, 1), seed: int = 1):
  """(tokens, valid) [len(lengths), width] int32 / bool: random ids in [2, vocab) left-aligned to
  each row's length, the rest padding (a batch of unequal prompts, one of them a single token)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(seed)
  toks, valid = np.zeros((len(lengths), width), np.int32), np.zeros((len(lengths), width), bool)
  for i, n in enumerate(lengths):
    toks[i, :n], valid[i, :n] = rng.integers(2, vocab, n), True
  return toks, valid


# Parametrizations run only with `-m slow`: each repeats a property another case of its test pins
# in the default suite (kept there: the other format / model / rule), at 10-40 s apiece on 2 cores.
SLOW_CASES = (
    "test_microbatch.py::test_accumulated_update_equals_one_shot[dppo_seq_mean-none]",
    "test_microbatch.py::test_accumulated_update_equals_one_shot[gspo_batch_tokens-none]",
    "test_microbatch.py::test_accumulated_update_equals_one_shot[minirl_seq_mean-none]",
    "test_microbatch.py::test_accumulated_update_equals_one_shot[sc_tis_constant-none]",
    "test_sampler.py::test_waves_and_prefill_chunks_equal_one_batch[moe-fp32]",
    "test_sampler.py::test_waves_and_prefill_chunks_equal_one_batch[dense-int8]",
    "test_sampler.py::test_decode_phases_equal_one_phase[moe-fp32]",
    "test_sampler.py::test_decode_phases_equal_one_phase[dense-fp4]",
    "test_sampler.py::test_quantized_kv_cache_follows_the_backend_switch[moe-fp8]",
    "test_sampler.py::test_quantized_kv_cache_follows_the_backend_switch[dense-int4]",
    "test_rl_step.py::test_response_slot_head_equals_the_full_forward[dense_tied]",
    "test_model.py::test_sharded_equals_single_device[dense]",
    # qwen2_moe stays: every switch of the MoE case plus q/k/v biases and the shared expert.
    "test_model.py::test_sharded_equals_single_device[moe]",
    "test_scan.py::test_scanned_routing_replay_equals_unrolled[alternating]",
    # e4-skewed keeps 4-way expert parallelism (under the hardest routing), e2t2-replay keeps
    # expert x tensor parallelism.
    "test_expert_parallel.py::test_model_loss_and_grads_equal_gspmd[shard_map-e4-normal]",
    "test_expert_parallel.py::test_model_loss_and_grads_equal_gspmd[shard_map-e4t2-normal]",
    # These formats keep their Pallas case (the same stacked quantization on the other backend).
    "test_scan_quant.py::test_stacked_quantization_equals_per_layer_bit_for_bit[fp4_e8m0_packed-xla]",
    "test_scan_quant.py::test_stacked_quantization_equals_per_layer_bit_for_bit[fp8_wa_block-xla]",
    "test_scan_quant.py::test_stacked_quantization_equals_per_layer_bit_for_bit[int4_block_packed-xla]",
)
# Whole tests run only with `-m slow`: what each pins is pinned in the default suite by the tests
# named beside it, or is a measurement rather than a contract. 15-37 s apiece on 2 cores.
SLOW_TESTS = (
    # KL 0 with a clean fp32 sampler: test_async.py's lag test asserts it at every lag, and
    # test_attribution.py's clean sampler attributes nothing.
    "test_rl_trainer.py::test_zero_mismatch_end_to_end",
    # The scanned sampler: test_scan.py's unsharded KV-cache and logits tests; a sharded sampler:
    # test_sampler.py::test_sharded_equals_unsharded.
    "test_scan.py::test_scanned_sampler_equals_unrolled_sharded",
    # seed_batch is the accelerator building block no study runs on CPU (docs/performance.md).
    "test_seed_batch.py::test_a_vmapped_seed_equals_the_seed_alone",
    # What the zero-mismatch mode removes, and its ulp at T != 1 (measurements behind docs/math.md);
    # the mode's contract, sampler == trainer bit for bit, stays in test_sampler_and_trainer_agree_bit_for_bit.
    "test_zero_mismatch.py::test_default_mode_is_close_but_not_exact_and_the_mode_trains",
    # A measurement (KL by format); each format's codec and kernels are pinned by test_quant_*.
    "test_sampler_quant.py::test_kl_grows_with_coarser_formats",
)


# Claims of bit equality between two programs (or two fusions of one) that hold at XLA:CPU's default
# emitters, which users' programs get, and not at the suite's faster classic ones (TEST_XLA_FLAGS):
# each case runs in a subprocess with RL_JAX_TEST_XLA_EMITTERS=default (LLVM's level stays the suite's).
USER_CODEGEN = (
    # The sampler's kept set {log q >= tau} against top-k's own tau: with the classic emitters the
    # comparison's fusion recomputes log q and can round the k-th token below tau.
    "test_sampling_mask.py::test_on_policy_ratios_are_one_in_both_modes",
    "test_scan_quant.py::test_quantized_sampler_scanned_equals_unrolled",
    "test_sampler_engine.py::test_continuous_equals_static_bitwise_in_the_invariant_mode",
)


def _run_at_user_codegen(item):
  """Replaces `item`'s call with the same node id run by pytest in a subprocess at the default emitters."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top

  def runtest():
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-m", "",
                           item.nodeid], cwd=str(item.config.rootpath), env=user_codegen_env("RL_JAX_TEST_XLA_EMITTERS"),
                          capture_output=True, text=True, timeout=1800, check=False)
    tail = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0 and "1 passed" in proc.stdout, f"at the default emitters:\n{tail}"
  item.runtest = runtest


@pytest.hookimpl(tryfirst=True)  # before the mark plugin deselects by `-m`
def pytest_collection_modifyitems(items):
  slow = set(SLOW_CASES) | set(SLOW_TESTS)
  user = os.environ.get("RL_JAX_TEST_XLA_EMITTERS", "") != "default" and set(USER_CODEGEN)
  for item in items:
    name = item.nodeid.split("/")[-1]
    if name in slow or name.split("[")[0] in slow:
      item.add_marker(pytest.mark.slow)
    if user and name.split("[")[0] in user:
      _run_at_user_codegen(item)


# `python -m rl_jax.main ARGS` whose Checkpointer.save, once step HOLD's checkpoint is written and
# finalized, prints "held" and blocks: a SIGKILL then lands between that checkpoint and the next on any
# machine, however fast or loaded (polling the checkpoint directory raced the run's next steps).
_HOLD_AFTER_CHECKPOINT = """
import runpy, sys, threading
from rl_jax import host_memory
host_memory.reexec_tuned()   # as rl_jax.main does first; re-runs this code with the allocator
from rl_jax import checkpoint
hold = int(sys.argv.pop(1))
real = checkpoint.Checkpointer.save
def save(self, step, items, meta):
  real(self, step, items, meta)
  if step == hold:
    self.wait_until_finished()
    print("held", flush=True)
    threading.Event().wait()
checkpoint.Checkpointer.save = save
sys.argv[0] = "rl_jax.main"
runpy.run_module("rl_jax.main", run_name="__main__", alter_sys=True)
"""


def run_clean_and_killed(cmd, clean, killed, kill_after: int, last: int):
  """Runs `cmd(clean)` to the end; runs `cmd(killed)` until checkpoint `kill_after` is finalized,
  SIGKILLs it there (before `last`), then reruns it to the end: the two workdirs of a kill -9
  resume test. `cmd(w)` is `["-m", "rl_jax.main", ARGS...]`."""
  import signal  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
  subprocess.run([sys.executable, *cmd(clean)], cwd=repo, env=env, check=True, capture_output=True)
  argv = cmd(killed)
  assert argv[:2] == ["-m", "rl_jax.main"], argv
  proc = subprocess.Popen([sys.executable, "-c", _HOLD_AFTER_CHECKPOINT, str(kill_after), *argv[2:]], cwd=repo,
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
  try:
    # Blocks until the run prints "held" (or exits: a crash before the checkpoint fails below).
    held = any(line.strip() == "held" for line in proc.stdout)
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
  assert held, f"the run exited with {proc.returncode} before checkpoint {kill_after}"
  assert (killed / "checkpoints" / str(kill_after)).exists()
  assert not (killed / "checkpoints" / str(last)).exists()
  subprocess.run([sys.executable, *cmd(killed)], cwd=repo, env=env, check=True, capture_output=True)
