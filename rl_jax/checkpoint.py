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


class Checkpointer:
  """Synchronous orbax CheckpointManager under `workdir/checkpoints`.

  Synchronous on purpose: a step returns only once its checkpoint is complete, so
  a kill -9 can at worst lose the step being written (orbax finalizes a step by
  an atomic rename; unfinished temporaries are ignored on restore).
  Only process 0 writes; every process restores. `workdir` may be local or remote (gs://...):
  paths go through etils epath (rl_jax.workdir.as_path), never os.path.

  A latest checkpoint that fails to restore (e.g. a truncated file) is skipped for the newest
  one that restores; process 0 then moves each bad step aside to `<workdir>/<subdir>.corrupt/
  <step>-<time>` (nothing is deleted). If none restores, nothing is moved and the latest's
  error is raised (e.g. a changed model shape fails on every step: no checkpoint is corrupt).
  """

  def __init__(self, workdir: Any, max_to_keep: int = 3, subdir: str = "checkpoints",
               create: bool = True):
    """`create=False` for readers (a warm-start lookup): a mistyped path is left uncreated."""
    self.directory = wd.as_path(workdir) / subdir
    self.corrupt_dir = wd.as_path(workdir) / f"{subdir}.corrupt"
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=create,
                                           enable_async_checkpointing=False)
    self.manager = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, items: dict[str, Any], meta: dict) -> None:
    """Saves named pytrees (e.g. params, opt_state) at `step`; refuses non-finite values."""
    bad = nonfinite_leaves(items)
    if bad:
      raise FloatingPointError(f"refusing to checkpoint step {step}: non-finite values in {bad[:5]}")
    args = {name: ocp.args.StandardSave(tree) for name, tree in items.items()}
    self.manager.save(step, args=ocp.args.Composite(meta=ocp.args.JsonSave(meta), **args), force=True)
    self.manager.wait_until_finished()

  def restore(self, targets: dict[str, Any], step: int | None = None) -> tuple[dict, dict, int]:
    """Restores the named items of `targets` (a subset is fine) into their structure / shardings.

    `step=None`: the latest step that restores (see the class docstring); an explicit step is
    restored or raises. Returns (items, meta, step).
    """
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
    self.manager.close()


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
