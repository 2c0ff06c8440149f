"""Asynchronous checkpoints: save returns before the write, a failed or killed write never shadows the last good step."""
import os
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from orbax.checkpoint._src.path import atomicity
from orbax.checkpoint._src.serialization import jax_array_handlers

from rl_jax.checkpoint import Checkpointer


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TMP_SUFFIX = ".orbax-checkpoint-tmp"  # orbax: a step is written here, then renamed to <step>


def _state(seed: int) -> dict:
  """Random values (every bit matters), one leaf sharded over the test devices."""
  k1, k2 = jax.random.split(jax.random.key(seed))
  mesh = Mesh(np.array(jax.devices()), ("fsdp",))
  w = jax.device_put(jax.random.normal(k1, (8, 16)), NamedSharding(mesh, P("fsdp", None)))
  b = jax.random.normal(k2, (5,)).astype(jnp.bfloat16)
  return {"params": {"w": w, "b": b}, "opt_state": {"count": jnp.int32(seed)}}


def _host(tree):
  return jax.tree.map(np.asarray, tree)


def _assert_bit_equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape
    assert x.tobytes() == y.tobytes()


def _names(directory):
  return sorted(os.listdir(directory))


@pytest.fixture
def gated_rename(monkeypatch):
  """Holds every step's finalize (the rename into place) until the returned event is set."""
  gate = threading.Event()
  real = atomicity.AtomicRenameTemporaryPath.finalize

  async def finalize(self, *args, **kwargs):
    import asyncio  # pylint: disable=g-import-not-at-top
    await asyncio.to_thread(gate.wait, 60)
    return await real(self, *args, **kwargs)
  monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", finalize)
  return gate


# Overwrites every leaf in place where XLA may (the arguments are donated), like a train step.
_overwrite = jax.jit(lambda t: jax.tree.map(lambda x: jnp.full_like(x, 7), t), donate_argnums=0)


def test_async_save_returns_before_the_write_and_the_next_save_waits(tmp_path, gated_rename):
  ck = Checkpointer(tmp_path)
  state1, want1 = _state(1), _host(_state(1))
  ck.save(1, state1, {"step": 1})
  directory = tmp_path / "checkpoints"
  # Returned with step 1 still unfinalized: only the temporary directory exists.
  names = _names(directory)
  assert "1" not in names and any(n.startswith("1" + TMP_SUFFIX) for n in names), names
  # Orbax already lists the step in flight; a reader on disk does not see it (nor would a
  # restart after a crash now).
  assert ck.manager.latest_step() == 1
  reader = Checkpointer(tmp_path, create=False)
  assert reader.latest_step() is None
  reader.close()
  # The loop goes on and overwrites the saved buffers while the write is pending.
  state1 = _overwrite(state1)
  np.testing.assert_array_equal(np.asarray(state1["params"]["w"]), 7.0)

  opened_at = []

  def open_gate():
    time.sleep(0.5)
    opened_at.append(time.monotonic())
    gated_rename.set()
  threading.Thread(target=open_gate).start()
  ck.save(2, _state(2), {"step": 2})
  # The second save started only once the first was finalized.
  assert opened_at and (directory / "1").is_dir()
  ck.close()
  assert "2" in _names(directory) and not any(TMP_SUFFIX in n for n in _names(directory))

  ck = Checkpointer(tmp_path)
  items, meta, step = ck.restore(_state(0))
  assert step == 2 and meta == {"step": 2}
  _assert_bit_equal(items, _state(2))
  items, meta, _ = ck.restore(_state(0), step=1)
  assert meta == {"step": 1}
  _assert_bit_equal(items, want1)  # the values at save time, not the overwritten buffers
  ck.close()


def test_latest_step_waits_for_the_save_in_flight(tmp_path, gated_rename):
  ck = Checkpointer(tmp_path)
  ck.save(3, _state(3), {"step": 3})
  threading.Timer(0.3, gated_rename.set).start()
  assert ck.latest_step() == 3 and (tmp_path / "checkpoints" / "3").is_dir()
  ck.close()


@pytest.mark.parametrize("max_to_keep", [1, 3])
def test_failed_write_keeps_the_previous_step_and_is_raised(tmp_path, monkeypatch, max_to_keep):
  ck = Checkpointer(tmp_path, max_to_keep=max_to_keep)
  ck.save(1, _state(1), {"step": 1})
  ck.wait_until_finished()
  real = jax_array_handlers._async_serialize_replica_slices  # pylint: disable=protected-access

  async def disk_full(*args, **kwargs):
    raise OSError(28, "No space left on device (injected)")
  monkeypatch.setattr(jax_array_handlers, "_async_serialize_replica_slices", disk_full)
  ck.save(2, _state(2), {"step": 2})  # returns: the array data is written in the background
  monkeypatch.setattr(jax_array_handlers, "_async_serialize_replica_slices", real)
  # max_to_keep=1 meant to delete step 1 once step 2 was in: it is still there, and listed.
  assert ck.latest_step() == 1
  with pytest.raises(RuntimeError, match=r"step 2 .*failed to write; the newest complete step is 1"):
    ck.save(3, _state(3), {"step": 3})
  items, meta, step = ck.restore(_state(0))
  assert step == 1 and meta == {"step": 1}
  _assert_bit_equal(items, _state(1))
  ck.save(3, _state(3), {"step": 3})  # the job may go on once the error was seen
  ck.close()
  ck = Checkpointer(tmp_path, create=False)
  assert ck.manager.all_steps() == ([3] if max_to_keep == 1 else [1, 3])
  ck.close()


def test_close_raises_a_failed_final_write(tmp_path, monkeypatch):
  ck = Checkpointer(tmp_path)
  ck.save(1, _state(1), {"step": 1})
  ck.wait_until_finished()

  async def rename_fails(self, *args, **kwargs):
    raise OSError("rename failed (injected)")
  monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", rename_fails)
  ck.save(2, _state(2), {"step": 2})
  with pytest.raises(RuntimeError, match="step 2 .*failed to write"):
    ck.close()
  monkeypatch.undo()
  ck = Checkpointer(tmp_path, create=False)
  assert ck.latest_step() == 1
  _assert_bit_equal(ck.restore(_state(0))[0], _state(1))
  ck.close()


_KILLED = r"""
import os, sys
sys.path.insert(0, {repo!r})
import jax, jax.numpy as jnp
from orbax.checkpoint._src.path import atomicity
from orbax.checkpoint._src.serialization import jax_array_handlers

from rl_jax.checkpoint import Checkpointer
from rl_jax.checkpoint import Checkpointer
sys.path.insert(0, os.path.join({repo!r}, "tests"))
from test_checkpoint_async import _state

import threading
ck = Checkpointer(sys.argv[1])
ck.save(1, _state(1), {{"step": 1}})
ck.wait_until_finished()
# The kill waits for save() to have returned (a fast background write could otherwise kill the
# process before the main thread prints); a save that blocked on the write times out and says so.
returned = threading.Event()
def kill():
  returned.wait(timeout=60)
  os._exit(17)
if sys.argv[2] == "write":  # killed after the array data went to disk, before the metadata
  real = jax_array_handlers._async_serialize_replica_slices
  async def write_then_die(*args, **kwargs):
    await real(*args, **kwargs)
    kill()
  jax_array_handlers._async_serialize_replica_slices = write_then_die
else:  # killed with every file written, just before the rename into place
  async def die(self, *args, **kwargs):
    kill()
  atomicity.AtomicRenameTemporaryPath.finalize = die
ck.save(2, _state(2), {{"step": 2}})
print("save returned", flush=True)
returned.set()
ck.wait_until_finished()
print("not killed", flush=True)
"""


@pytest.mark.parametrize("where", ["write", "rename"])
def test_kill_during_the_async_write_leaves_the_previous_step(tmp_path, where):
  code = _KILLED.format(repo=REPO)
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
  proc = subprocess.run([sys.executable, "-c", code, str(tmp_path), where], capture_output=True,
                        text=True, env=env, timeout=300, cwd=REPO, check=False)
  assert proc.returncode == 17, proc.stdout + proc.stderr[-3000:]
  assert "save returned" in proc.stdout and "not killed" not in proc.stdout
  directory = tmp_path / "checkpoints"
  names = _names(directory)
  assert "1" in names and "2" not in names and any(n.startswith("2" + TMP_SUFFIX) for n in names), names

  reader = Checkpointer(tmp_path, create=False)  # readers leave the leftovers alone
  assert reader.latest_step() == 1
  items, meta, step = reader.restore(_state(0))
  assert step == 1 and meta == {"step": 1}
  _assert_bit_equal(items, _state(1))
  reader.close()
  assert any(n.startswith("2" + TMP_SUFFIX) for n in _names(directory))

  # The resumed run's writer removes the killed attempt's leftovers (step 3: a step 2 would
  # reuse the same temporary directory and hide whether they were removed).
  ck = Checkpointer(tmp_path)
  ck.save(3, _state(3), {"step": 3})
  ck.close()
  assert _names(directory) == ["1", "3"]
  ck = Checkpointer(tmp_path, create=False)
  _assert_bit_equal(ck.restore(_state(0))[0], _state(3))
  ck.close()


def test_sync_mode_writes_inside_save(tmp_path, gated_rename):
  ck = Checkpointer(tmp_path, async_save=False)
  threading.Timer(0.3, gated_rename.set).start()
  ck.save(1, _state(1), {"step": 1})
  assert gated_rename.is_set() and (tmp_path / "checkpoints" / "1").is_dir()
  ck.close()
