"""Two local CPU processes join through rl_jax.distributed.maybe_initialize and sum a global array."""
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from rl_jax import distributed

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 120

WORKER = textwrap.dedent("""
    import jax
    from rl_jax import distributed
    assert distributed.maybe_initialize(), "maybe_initialize did not initialize"
    assert jax.process_count() == 2, jax.process_count()
    assert jax.device_count() == 2 * jax.local_device_count(), (jax.device_count(), jax.local_device_count())
    distributed.check_global_sum()
    print("WORKER_OK", jax.process_index(), flush=True)
""")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _child_env(**extra) -> dict:
  env = {k: v for k, v in os.environ.items() if not k.startswith("RL_JAX_")}
  # Two simulated devices per process (conftest's 8 would be inherited otherwise): 4 global.
  env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2",
             PYTHONPATH=REPO + os.pathsep + env.get("PYTHONPATH", ""), RL_JAX_INIT_TIMEOUT="60")
  env.update(extra)
  return env


def _two_processes(args: list[str], timeout: int = TIMEOUT_S) -> list[str]:
  """Runs `python ARGS` as processes 0 and 1 of one job; returns their outputs (rc 0 asserted)."""
  port = _free_port()
  procs = [subprocess.Popen([sys.executable, *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env=_child_env(RL_JAX_COORDINATOR=f"127.0.0.1:{port}", WANDB_MODE="disabled",
                                           RL_JAX_NUM_PROCESSES="2", RL_JAX_PROCESS_ID=str(i)))
           for i in range(2)]
  outs = []
  try:
    for p in procs:
      outs.append(p.communicate(timeout=timeout)[0])
  finally:
    # A peer left waiting in a collective would never exit by itself.
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.communicate()
  for i, (p, out) in enumerate(zip(procs, outs)):
    assert p.returncode == 0, f"process {i} (rc {p.returncode}):\n{out[-5000:]}"
  return outs


PREEMPT_WORKER = textwrap.dedent("""
    import signal, jax
    from rl_jax import distributed, preempt
    distributed.maybe_initialize()
    guard = preempt.Guard()
    assert not guard.stop_requested()          # nobody signalled: both go on
    if jax.process_index() == 1:               # a SIGTERM that reached one host only
      guard.signum = int(signal.SIGTERM)
    assert guard.stop_requested() and guard.signum == signal.SIGTERM, guard.signum
    print("PREEMPT_AGREED", jax.process_index(), flush=True)
""")


def test_a_signal_on_one_process_stops_every_process_after_the_same_step():
  for i, out in enumerate(_two_processes(["-c", PREEMPT_WORKER])):
    assert f"PREEMPT_AGREED {i}" in out, f"process {i}:\n{out}"


FALLBACK_WORKER = textwrap.dedent("""
    import os, sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.experimental import multihost_utils
    from rl_jax import distributed, sharding as sh
    from rl_jax.checkpoint import Checkpointer
    distributed.maybe_initialize()
    root = sys.argv[1]
    mesh = sh.make_mesh(sh.MeshConfig(fsdp=-1))
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
    tiny = lambda v: {"w": jax.make_array_from_callback((8, 4), spec, lambda i: np.full((8, 4), v, np.float32)[i])}
    ckpt = Checkpointer(root)
    for step in (2, 4):
      ckpt.save(step, {"params": tiny(step)}, {"step": step})
    ckpt.close()
    multihost_utils.sync_global_devices("saved")
    if jax.process_index() == 0:   # a truncated data file in the latest step
      d = os.path.join(root, "checkpoints", "4", "params", "d")
      path = os.path.join(d, sorted(os.listdir(d))[0])
      with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    multihost_utils.sync_global_devices("truncated")
    ckpt = Checkpointer(root)
    items, meta, step = ckpt.restore({"params": tiny(0)})
    w = sh.to_host(items["params"]["w"])
    assert step == 2 and meta == {"step": 2} and float(w.min()) == float(w.max()) == 2.0, (step, meta)
    multihost_utils.sync_global_devices("restored")
    assert ckpt.latest_step() == 2
    ckpt.save(6, {"params": tiny(6)}, {"step": 6})   # the run goes on from the fallback
    ckpt.close()
    print("FALLBACK_OK", jax.process_index(), sorted(os.listdir(os.path.join(root, "checkpoints.corrupt"))), flush=True)
""")


def test_corrupt_latest_checkpoint_falls_back_on_two_processes(tmp_path):
  """A truncated latest step on a 2-process job: both processes restore the step before it, the
  bad one is moved aside once, and the job saves on from there."""
  for i, out in enumerate(_two_processes(["-c", FALLBACK_WORKER, str(tmp_path)])):
    assert f"FALLBACK_OK {i}" in out, f"process {i}:\n{out}"
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2", "6"]
  (moved,) = os.listdir(tmp_path / "checkpoints.corrupt")
  assert moved.startswith("4-")


def test_two_processes_global_sum():
  outs = _two_processes(["-c", WORKER])
  for i, out in enumerate(outs):
    assert f"WORKER_OK {i}" in out, f"process {i}:\n{out}"


def test_launcher_script_runs_selftest(tmp_path):
  """launch/local_multiprocess.sh starts the processes and `python -m rl_jax.distributed` checks them."""
  script = os.path.join(REPO, "launch", "local_multiprocess.sh")
  env = _child_env(RL_JAX_MODULE="rl_jax.distributed", RL_JAX_PORT=str(_free_port()),
                   DEVICES_PER_PROCESS="2", LOG_DIR=str(tmp_path), PYTHON=sys.executable,
                   TIMEOUT_S=str(TIMEOUT_S))
  r = subprocess.run(["bash", script, "2"], cwd=REPO, env=env, capture_output=True, text=True,
                     timeout=TIMEOUT_S + 30)
  logs = {f: (tmp_path / f).read_text() for f in sorted(os.listdir(tmp_path))}
  assert r.returncode == 0, (r.stdout, r.stderr, logs)
  for i in range(2):
    assert f"process {i}/2 joined=True devices local=2 global=4 global_sum=24.0 OK" in logs[
        f"process_{i}.log"], logs


def test_maybe_initialize_noop_and_errors():
  assert distributed.maybe_initialize({}) is False
  assert distributed.maybe_initialize({"RL_JAX_DISTRIBUTED": "off"}) is False
  with pytest.raises(ValueError, match="RL_JAX_PROCESS_ID"):
    distributed.maybe_initialize({"RL_JAX_COORDINATOR": "127.0.0.1:1", "RL_JAX_NUM_PROCESSES": "2"})
  with pytest.raises(ValueError, match=r"not in \[0"):
    distributed.maybe_initialize({"RL_JAX_COORDINATOR": "127.0.0.1:1", "RL_JAX_NUM_PROCESSES": "2",
                                  "RL_JAX_PROCESS_ID": "2"})
  with pytest.raises(ValueError, match="RL_JAX_DISTRIBUTED"):
    distributed.maybe_initialize({"RL_JAX_DISTRIBUTED": "yes"})


def test_launch_scripts_parse():
  for name in ("local_multiprocess.sh", "tpu_pod.sh", "slurm_gpu.sbatch"):
    r = subprocess.run(["bash", "-n", os.path.join(REPO, "launch", name)], capture_output=True, text=True)
    assert r.returncode == 0, (name, r.stderr)


COMPARE = textwrap.dedent("""
    import sys
    import jax, numpy as np
    from rl_jax.configs import countdown_tiny
    from rl_jax.rl.trainer import RLTrainer
    def config():
      c = countdown_tiny.get_config("test")
      c.warm_start.source = "none"
      c.advantage.mode, c.advantage.reward_mode = "raw", "pm1"  # as the runs were started
      c.rl.steps = 4
      c.logging.wandb_mode = "disabled"
      return c
    a, b = (jax.tree.leaves(RLTrainer(config(), d).state) for d in sys.argv[1:3])
    print("MAXDIFF", max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(a, b)))
""")


@pytest.mark.slow
def test_two_process_rl_run_matches_one_process_and_resumes(tmp_path):
  """The RL job on 2 processes x 2 devices (killed after step 2, resumed) == 1 process x 4 devices.

  Same mesh and data, so only the cross-process reduction order differs (float tolerance).
  `raw` {-1, +1} advantages give a policy gradient although a random-init policy scores 0.
  """
  base = ["-m", "rl_jax.main", "--config=configs/countdown_tiny.py:test", "--config.warm_start.source=none",
          "--config.advantage.mode=raw", "--config.advantage.reward_mode=pm1"]
  multi, single = tmp_path / "multi", tmp_path / "single"
  _two_processes(base + [f"--workdir={multi}", "--config.rl.steps=2"], timeout=600)
  _two_processes(base + [f"--workdir={multi}", "--config.rl.steps=4"], timeout=600)  # resumes from step 2
  env = _child_env(XLA_FLAGS="--xla_force_host_platform_device_count=4", WANDB_MODE="disabled")
  subprocess.run([sys.executable, *base, f"--workdir={single}", "--config.rl.steps=4"], cwd=REPO,
                 env=env, check=True, capture_output=True, timeout=600)
  r = subprocess.run([sys.executable, "-c", COMPARE, str(single), str(multi)], cwd=REPO, env=env,
                     capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-5000:]
  diff = float(r.stdout.split("MAXDIFF")[1])
  # Observed 5e-7 (Gloo all-reduces sum in another order than one process's XLA).
  assert diff < 1e-5, diff


@pytest.mark.slow  # ~4 min: SFT then async RL on 2 processes, preempted and resumed
def test_readme_two_process_command_with_sft_async_preempted_and_resumed(tmp_path):
  """The README's launch command as a user runs it (its SFT warm start included), in async mode on
  2 processes x 2 devices: SIGTERM to the launcher is forwarded, both processes checkpoint the same
  step and exit 75, and the rerun resumes with the rollout in flight, writing each step once."""
  script = os.path.join(REPO, "launch", "local_multiprocess.sh")
  workdir = tmp_path / "run"
  cmd = [script, "2", "--config=configs/countdown_tiny.py:test", f"--workdir={workdir}",
         "--config.rl.mode=async", "--config.mesh.sampler_devices=2", "--config.rl.steps=12",
         "--config.rl.checkpoint_every=100", "--config.rl.eval_every=100"]
  env = _child_env(DEVICES_PER_PROCESS="2", TIMEOUT_S="900", WANDB_MODE="disabled")
  proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  metrics = workdir / "metrics.jsonl"
  deadline = time.time() + 900
  while time.time() < deadline and proc.poll() is None:
    if metrics.exists() and metrics.read_text().count('"reward"') >= 2:
      break
    time.sleep(1)
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=600)
  assert proc.returncode == 75, out[-3000:]
  steps = [int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()]
  assert len(steps) == 1 and 2 <= steps[0] < 12, (steps, out[-3000:])
  r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  assert f"resumed from step {steps[0]}" in r.stdout + r.stderr
  rows = [json.loads(line) for line in metrics.read_text().splitlines()]
  assert [row["step"] for row in rows if "reward" in row] == list(range(1, 13))
  assert [row["async/lag"] for row in rows if "reward" in row] == [0.0] + [1.0] * 11
