"""The host-allocator re-exec: when it preloads what, and when it leaves the process alone."""
import os
import subprocess
import sys

import pytest

from rl_jax import host_memory as hm

FAKE = ("/opt/lib/libtcmalloc_minimal.so.4", {"TCMALLOC_RELEASE_RATE": "0"})


@pytest.fixture
def linux_glibc(monkeypatch):
  monkeypatch.setattr(hm.sys, "platform", "linux")
  monkeypatch.setattr(hm.platform, "libc_ver", lambda: ("glibc", "2.36"))
  monkeypatch.setattr(hm, "find_allocator", lambda choice="auto": FAKE)


def test_cpu_run_preloads_the_allocator_and_marks_the_child(linux_glibc):
  env = hm.tuned_env({"JAX_PLATFORMS": "cpu", "PATH": "/bin"})
  assert env == {"JAX_PLATFORMS": "cpu", "PATH": "/bin", "LD_PRELOAD": FAKE[0],
                 "TCMALLOC_RELEASE_RATE": "0", hm.SWITCH: "on"}
  # The re-executed process (marked "on") does nothing: no exec loop.
  assert hm.tuned_env(env) is None


def test_caller_variables_win_and_an_existing_preload_is_kept(linux_glibc):
  env = hm.tuned_env({"JAX_PLATFORMS": "cpu", "TCMALLOC_RELEASE_RATE": "5", "LD_PRELOAD": "/x/libfoo.so"})
  assert env["TCMALLOC_RELEASE_RATE"] == "5"
  assert env["LD_PRELOAD"] == f"{FAKE[0]}:/x/libfoo.so"
  assert hm.tuned_env({"JAX_PLATFORMS": "cpu", "LD_PRELOAD": FAKE[0]}) is None  # already preloaded


@pytest.mark.parametrize("environ", [
    {"JAX_PLATFORMS": "cpu", hm.SWITCH: "0"},  # switched off
    {"JAX_PLATFORMS": "cuda"},  # an accelerator run: host memory is not where the steps live
    {"JAX_PLATFORMS": "tpu,cpu"},
])
def test_left_alone(linux_glibc, environ):
  assert hm.tuned_env(environ) is None


def test_not_glibc_is_left_alone(linux_glibc, monkeypatch):
  monkeypatch.setattr(hm.platform, "libc_ver", lambda: ("", ""))
  assert hm.tuned_env({"JAX_PLATFORMS": "cpu"}) is None


def test_no_allocator_installed_prints_the_hint(linux_glibc, monkeypatch, capsys):
  monkeypatch.setattr(hm, "find_allocator", lambda choice="auto": None)
  assert hm.tuned_env({"JAX_PLATFORMS": "cpu"}) is None
  err = capsys.readouterr().err
  assert "pip install cmeel-mimalloc" in err and "apt install libtcmalloc-minimal4" in err


def test_the_wheel_allocator_comes_first_with_its_purge_delay_off(tmp_path, monkeypatch):
  wheel_lib, system_lib = tmp_path / "wheel", tmp_path / "system"
  wheel_lib.mkdir(), system_lib.mkdir()
  (system_lib / "libtcmalloc_minimal.so.4").write_bytes(b"")
  monkeypatch.setattr(hm, "WHEEL_LIB_DIRS", (str(wheel_lib),))
  monkeypatch.setattr(hm, "LIB_DIRS", (str(system_lib),))
  assert hm.find_allocator() == (str(system_lib / "libtcmalloc_minimal.so.4"), {"TCMALLOC_RELEASE_RATE": "0"})
  (wheel_lib / "libmimalloc.so").write_bytes(b"")
  assert hm.find_allocator() == (str(wheel_lib / "libmimalloc.so"), {"MIMALLOC_PURGE_DELAY": "-1"})
  assert hm.describe({"LD_PRELOAD": str(wheel_lib / "libmimalloc.so")}) == "libmimalloc.so"


@pytest.mark.skipif(not (sys.platform == "linux" and os.uname().machine == "x86_64"),
                    reason="cmeel-mimalloc is a dependency on x86-64 Linux only (setup.py)")
def test_the_installed_package_brings_its_allocator():
  """`pip install rl_jax` alone gives the entry points an allocator to preload (setup.py's dependency)."""
  found = hm.find_allocator()
  assert found is not None and os.path.isfile(found[0]), found


def test_a_named_library_must_exist_and_gets_its_variables(tmp_path):
  with pytest.raises(FileNotFoundError, match=hm.SWITCH):
    hm.find_allocator(str(tmp_path / "libtcmalloc.so.4"))
  lib = tmp_path / "libjemalloc.so.2"
  lib.write_bytes(b"")
  path, env = hm.find_allocator(str(lib))
  assert path == str(lib) and env == {"MALLOC_CONF": "dirty_decay_ms:-1,muzzy_decay_ms:-1"}


def test_reexec_runs_the_same_command_line_once(tmp_path):
  """A real exec: the child sees the preload marker and the same argv; the parent's code after it never runs."""
  script = tmp_path / "entry.py"
  script.write_text(
      "import os, sys\n"
      "from rl_jax import host_memory\n"
      "print('start', os.environ.get('RL_JAX_HOST_MALLOC'), flush=True)\n"
      "host_memory.tuned_env = lambda e: None if e.get('RL_JAX_HOST_MALLOC') == 'on' else "
      "{**e, 'RL_JAX_HOST_MALLOC': 'on'}\n"
      "host_memory.reexec_tuned()\n"
      "print('after', sys.argv[1:], os.environ['RL_JAX_HOST_MALLOC'])\n")
  root = os.path.dirname(os.path.dirname(hm.__file__))
  env = {k: v for k, v in os.environ.items() if k != hm.SWITCH}
  env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
  out = subprocess.run([sys.executable, str(script), "--flag=1"], capture_output=True, text=True, env=env,
                       check=True)
  assert out.stdout.splitlines() == ["start None", "start on", "after ['--flag=1'] on"]
