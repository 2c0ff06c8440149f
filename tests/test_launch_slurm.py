"""launch/slurm_gpu.sbatch under fake `srun` / `scontrol`: the srun line it builds and the env it wires."""
import os
import stat
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "launch", "slurm_gpu.sbatch")


def _fake(bin_dir, name, body):
  path = bin_dir / name
  path.write_text("#!/bin/bash\n" + body)
  path.chmod(path.stat().st_mode | stat.S_IEXEC)


def _run(tmp_path, n_hosts=2, **slurm_env):
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  # srun records its arguments and the wiring variables instead of launching anything.
  _fake(bin_dir, "srun", 'printf "%s\\n" "$@" > "$FAKE_OUT/srun_args"\n'
        'env | grep ^RL_JAX_ | sort > "$FAKE_OUT/srun_env"\n')
  _fake(bin_dir, "scontrol", f'printf "node-a\\nnode-b\\n"; for i in $(seq 3 {n_hosts}); do echo node-$i; done\n')
  env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RL_JAX_"))}
  env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", FAKE_OUT=str(tmp_path), REPO_DIR=REPO,
             SLURM_JOB_NODELIST="node-[a-b]", SLURM_JOB_ID="123", SLURM_NNODES="2", **slurm_env)
  r = subprocess.run(["bash", SCRIPT, "--config=configs/countdown_tiny.py:test", "--workdir=/x"],
                     env=env, capture_output=True, text=True, timeout=60)
  return r


def test_srun_gets_cpus_per_task_explicitly(tmp_path):
  r = _run(tmp_path, SLURM_CPUS_PER_TASK="32")
  assert r.returncode == 0, r.stderr
  args = (tmp_path / "srun_args").read_text().splitlines()
  # Slurm >= 22.05: srun no longer inherits the job's --cpus-per-task.
  assert "--cpus-per-task=32" in args and "--nodes=2" in args and "--ntasks-per-node=1" in args, args
  assert args[-2:] == ["--config=configs/countdown_tiny.py:test", "--workdir=/x"], args
  wired = dict(line.split("=", 1) for line in (tmp_path / "srun_env").read_text().splitlines())
  assert wired["RL_JAX_COORDINATOR"] == "node-a:20123" and wired["RL_JAX_NUM_PROCESSES"] == "2", wired


def test_missing_cpus_per_task_is_a_clear_error(tmp_path):
  r = _run(tmp_path)
  assert r.returncode != 0 and "--cpus-per-task" in r.stderr, r.stderr
  assert not (tmp_path / "srun_args").exists()


def test_a_long_host_list_does_not_kill_the_script(tmp_path):
  """A many-node `scontrol show hostnames` (more than a pipe buffer) must not SIGPIPE the script."""
  r = _run(tmp_path, n_hosts=20000, SLURM_CPUS_PER_TASK="32")
  assert r.returncode == 0, (r.returncode, r.stderr)
  wired = dict(line.split("=", 1) for line in (tmp_path / "srun_env").read_text().splitlines())
  assert wired["RL_JAX_COORDINATOR"] == "node-a:20123", wired
