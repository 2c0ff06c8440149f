"""Orbax checkpoints of a training state pytree plus JSON metadata; resume from the latest."""
from __future__ import annotations

import datetime
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from rl_jax import sharding as sh
from rl_jax import workdir as wd

# How long a background write may take before orbax gives up on it (its default is 20 min):
# a multi-hundred-GB state on a slow file system needs longer, and a stuck write still ends.
ASYNC_TIMEOUT_S = 4 * 3600


class Checkpointer:
  """Orbax CheckpointManager under `workdir/checkpoints`, asynchronous by default.

  `save` returns once the state is on the host (orbax copies every array device-to-host
  before `save` returns, so the step loop may donate or overwrite the buffers right after)
  and the files are written by a background thread. The next `save`, `wait_until_finished`,
  `latest_step`, `restore` and `close` wait for that write; a write that failed is raised
  by the next `save` or `close` (or `wait_until_finished`), so a job cannot run on without
  checkpoints. `async_save=False` writes inside `save`.

  A crash or kill mid-save cannot leave a half-written latest checkpoint: orbax writes a step
  to `<step>.orbax-checkpoint-tmp-*` and renames it into place when every file is written (on
  gs://, where rename is not atomic, it writes `<step>/commit_success.txt` last), and it lists
  only finalized steps. Older steps beyond `max_to_keep` are deleted only after the new one is
  finalized. A writer (`create=True`) removes unfinalized leftovers when it opens.
  Orbax's primary host (process 0) writes the metadata and finalizes; every process writes
  the array shards it owns, and every process restores. `workdir` may be local or remote
  (gs://...): paths go through etils epath (rl_jax.workdir.as_path), never os.path.

  A latest checkpoint that fails to restore (e.g. a truncated file) is skipped for the newest
  one that restores; process 0 then moves each bad step aside to `<workdir>/<subdir>.corrupt/
  <step>-<time>` (nothing is deleted). If none restores, nothing is moved and the latest's
  error is raised (e.g. a changed model shape fails on every step: no checkpoint is corrupt).
  """

  def __init__(self, workdir: Any, max_to_keep: int = 3, subdir: str = "checkpoints",
               create: bool = True, async_save: bool = True,
               async_timeout_s: int = ASYNC_TIMEOUT_S):
    """`create=False` for readers (a warm-start lookup): a mistyped path is left uncreated."""
    self.directory = wd.as_path(workdir) / subdir
    self.corrupt_dir = wd.as_path(workdir) / f"{subdir}.corrupt"
    self.async_save = async_save
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, create=create, enable_async_checkpointing=async_save,
        # Only a writer (it holds the workdir lock) may delete a killed save's leftovers.
        cleanup_tmp_directories=create,
        async_options=ocp.AsyncOptions(timeout_secs=async_timeout_s))
    self.manager = ocp.CheckpointManager(self.directory, options=options)
    self._writing: int | None = None  # the step of the save in flight
    self._error: BaseException | None = None  # its failure, until raised

  def latest_step(self) -> int | None:
    """The newest finalized step; waits for a save in flight (a failed one does not count)."""
    self._wait()
    return self.manager.latest_step()

  def save(self, step: int, items: dict[str, Any], meta: dict) -> None:
    """Saves named pytrees (e.g. params, opt_state) at `step`; refuses non-finite values.

    Asynchronous (see the class docstring): waits for the previous save, raises its failure,
    and returns once `items` are copied to the host.
    """
    bad = nonfinite_leaves(items)
    if bad:
      raise FloatingPointError(f"refusing to checkpoint step {step}: non-finite values in {bad[:5]}")
    self.wait_until_finished()
    args = {name: ocp.args.StandardSave(tree) for name, tree in items.items()}
    self.manager.save(step, args=ocp.args.Composite(meta=ocp.args.JsonSave(meta), **args), force=True)
    self._writing = step
    if not self.async_save:
      self.wait_until_finished()

  def wait_until_finished(self) -> None:
    """Blocks until the save in flight is finalized; raises its failure (once)."""
    self._wait()
    if self._error is not None:
      error, self._error = self._error, None
      raise error

  def _wait(self) -> None:
    """Waits for the save in flight and keeps its failure for `wait_until_finished`.

    Kept rather than raised here: orbax raises a background failure only once, and
    `latest_step` runs inside error messages, where raising would hide the original error.
    """
    if self._writing is None:
      return
    step, self._writing = self._writing, None
    try:
      self.manager.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except
      # Orbax already dropped `step` from its list, and the older steps it meant to delete
      # (beyond max_to_keep) are still on disk: list the directory again.
      self.manager.reload()
      self._error = RuntimeError(
          f"checkpoint step {step} in {self.directory} failed to write; the newest complete "
          f"step is {self.manager.latest_step()}: {type(e).__name__}: {e}")
      self._error.__cause__ = e

  def restore(self, targets: dict[str, Any], step: int | None = None) -> tuple[dict, dict, int]:
    """Restores the named items of `targets` (a subset is fine) into their structure / shardings.

    `step=None`: the latest step that restores (see the class docstring); an explicit step is
    restored or raises. Returns (items, meta, step).
    """
    self._wait()  # a save in flight is listed already: restore it only once it is on disk
    if step is not None:
      return self._restore(targets, step)
    steps = sorted(self.manager.all_steps(), reverse=True)
    if not steps:
      raise FileNotFoundError(f"no checkpoint in {self.directory}")
    failed: list[tuple[int, Exception]] = []
    for s in steps:
      try:
        out = self._restore(targets, s)
      except Exception as e:  # pylint: disable=broad-except
        print(f"[checkpoint] step {s} in {self.directory} does not restore: "
              f"{type(e).__name__}: {str(e)[:300]}")
        failed.append((s, e))
        continue
      if failed:
        print(f"[checkpoint] falling back to step {s} (newest that restores)")
        self._move_aside([f for f, _ in failed])
      return out
    raise failed[0][1]

  def _restore(self, targets: dict[str, Any], step: int) -> tuple[dict, dict, int]:
    args = {name: ocp.args.StandardRestore(jax.tree.map(_abstract, tree)) for name, tree in targets.items()}
    out = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore(), **args))
    return {name: out[name] for name in targets}, out["meta"], step

  def _move_aside(self, steps: list[int]) -> None:
    """Process 0 renames bad step directories out of the manager's view; others only reload."""
    if jax.process_index() == 0:
      self.corrupt_dir.mkdir(parents=True, exist_ok=True)
      stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S")
      for s in steps:
        src = self.directory / str(s)
        dst = self.corrupt_dir / f"{s}-{stamp}"
        src.rename(dst)
        print(f"[checkpoint] moved the unrestorable step {s} to {dst}")
    self.manager.reload()

  def close(self) -> None:
    """Waits for the save in flight, closes orbax, then raises that save's failure if any."""
    try:
      self._wait()
    finally:
      self.manager.close()
    self.wait_until_finished()


@jax.jit
def _all_finite(leaves: list) -> jax.Array:
  return jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])


def nonfinite_leaves(items: dict[str, Any]) -> list[str]:
  """Paths of the floating leaves holding a NaN or inf.

  Reduced on device, one bool per leaf comes back: nothing is copied to the host, and it
  works for arrays sharded over processes (which no single process can read whole).
  """
  paths, leaves = [], []
  for name, tree in items.items():
    for p, x in jax.tree_util.tree_leaves_with_path(tree):
      dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
      if jnp.issubdtype(dtype, jnp.floating):
        paths.append(f"{name}{jax.tree_util.keystr(p)}")
        leaves.append(x)
  if not leaves:
    return []
  ok = sh.to_host(_all_finite(leaves))
  return [path for path, good in zip(paths, ok) if not good]


def _abstract(x):
  if isinstance(x, jax.Array):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
  return x
