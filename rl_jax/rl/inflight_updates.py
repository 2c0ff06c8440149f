"""In-flight weight updates: async rollouts generated in chunks, the sampler taking the newest weights between them."""
from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rl_jax import rollout as rollout_lib
from rl_jax import sharding as sh

# The schedule (docs/architecture.md#in-flight-weight-updates), rl.max_staleness = K >= 1:
#   - the rollout of step t begins at step t - K: the sampler holds version t - K, and the first
#     `rl.inflight_chunk` engine iterations run (prefill of the first slots included);
#   - at each step s in (t - K, t) the sampler takes version s and the rollout runs one more chunk;
#   - at step t, before the trainer's p_old forward, the rest runs at version t (the trainer waits
#     for it), then the rollout is scored and trained on.
# Every token records the version that sampled it (`Rollout.version_BT`); the slots keep their
# rows and KV cache across the swaps (the cache holds keys and values the older weights wrote, as
# in PipelineRL). The rollout's own version, `InFlight.version`, is the one that began it, so
# `async/lag` is the oldest token's lag, K once the pipeline is full, as without in-flight updates.


@dataclasses.dataclass
class Partial:
  """The rollout of RL step `step` in generation: begun by version `version`, its engine carry after
  the chunks run so far (the last at `advanced`, a step), and under `rl.p_old_version='rollout'`
  the params of `version` (`keep`, for its p_old forward)."""
  step: int
  version: int
  problems: list
  carry: dict
  advanced: int
  keep: Any = None


def rollout_inputs(tr, step: int):
  """(problems, prompt ids, valid, key) of the rollout of `step`, each prompt repeated `group_size`
  times: `RLTrainer.rollout`'s, on the sampler's devices (`begin` and a re-prefilled resume)."""
  g = tr.job.rl.group_size
  problems, ids, valid = tr.prompts(step)
  with sh.mesh_context(tr.sampler_mesh):
    ids, valid = rollout_lib.repeat_prompts((ids, valid), g)
    key = jax.random.fold_in(jax.random.key(tr.job.seed), step)
  return [p for p in problems for _ in range(g)], ids, valid, key


def begin(tr, step: int, version: int, keep=None) -> Partial:
  """The rollout of `step` begun with the sampler's weights (`version`): prompts and key as
  `RLTrainer.rollout`'s, the first chunk dispatched."""
  problems, ids, valid, key = rollout_inputs(tr, step)
  with sh.mesh_context(tr.sampler_mesh):
    t = time.perf_counter()
    carry = tr.busy.track("sampler", tr.programs.sampler.start_rollout(tr.sampler_state, ids, valid, key, version=version,
                                                               n_iters=tr.job.rl.inflight_chunk), t)
  return Partial(step=step, version=version, problems=problems, carry=carry, advanced=version, keep=keep)


def advance(tr, part: Partial, version: int, to_the_end: bool = False) -> None:
  """One more chunk of `part` (or the rest of it) with the sampler's weights, recorded as `version`."""
  n = {} if to_the_end else {"n_iters": tr.job.rl.inflight_chunk}
  with sh.mesh_context(tr.sampler_mesh):
    t = time.perf_counter()
    part.carry = tr.busy.track("sampler", tr.programs.sampler.advance_rollout(tr.sampler_state, part.carry, version=version,
                                                                      **n), t)
  part.advanced = version


def token_lag_metrics(version_BT, mask_BT, step: int, max_lag: int) -> dict:
  """`async/token_lag_*` of a trained rollout: per response token, the updates between the version
  that sampled it and the trainer's (`step`): mean, max and the share at each lag 0..`max_lag`."""
  lag = step - np.asarray(version_BT)[np.asarray(mask_BT, bool)]
  out = {"async/token_lag_mean": float(lag.mean()) if lag.size else 0.0,
         "async/token_lag_max": float(lag.max()) if lag.size else 0.0}
  for l in range(max_lag + 1):
    out[f"async/token_lag_share/{l}"] = float((lag == l).mean()) if lag.size else 0.0
  return out


def summary(train_rows: list[dict]) -> dict:
  """summary.json's `token_lag_share` (each lag's share of the run's response tokens: a step's
  shares weighted by its tokens, mean length x the constant rows) and `token_lag_mean`; {} for a
  run without in-flight updates."""
  rows = [r for r in train_rows if "async/token_lag_mean" in r]
  if not rows:
    return {}
  w = np.asarray([r["response_length"] for r in rows], np.float64)
  w = w / w.sum() if w.sum() > 0 else np.full(len(rows), 1 / len(rows))
  lags = sorted({int(k.rsplit("/", 1)[1]) for r in rows for k in r if k.startswith("async/token_lag_share/")})
  return {"token_lag_mean": float(sum(wi * r["async/token_lag_mean"] for wi, r in zip(w, rows))),
          "token_lag_share": {str(l): float(sum(wi * r.get(f"async/token_lag_share/{l}", 0.0) for wi, r in zip(w, rows)))
                              for l in lags}}


def async_step(tr, step: int) -> dict:
  """Step s of the async loop with in-flight updates (`RLTrainer.train_step`; the module's schedule).

  Order of dispatch: the sampler's weights of version s (before update s donates the params), the
  rest of the rollout of step s, one chunk of every other rollout in flight, the first chunk of
  the rollout of step s + K; then the host waits for the tokens of step s, scores them, and the
  trainer's p_old forward and updates run while the sampler works through the chunks.
  """
  rl = tr.job.rl
  k = rl.max_staleness
  keep = lambda: jax.tree.map(jnp.copy, tr.state["params"]) if rl.p_old_version == "rollout" else None
  t0 = time.perf_counter()
  if not tr.queue:  # a fresh run: steps s..s+K-1 begin at the initial weights
    for s in range(step, min(step + k, rl.steps)):
      tr.queue.append(begin(tr, s, step, keep()))
  head = tr.queue.popleft()
  assert head.step == step, (head.step, step)
  tr.sync_sampler()  # version `step`
  advance(tr, head, step, to_the_end=True)
  with sh.mesh_context(tr.sampler_mesh):
    ro = tr.programs.sampler.finish_rollout(head.carry)
  for part in tr.queue:
    if part.advanced < step:
      advance(tr, part, step)
  ahead = step + k
  if ahead < rl.steps:
    tr.queue.append(begin(tr, ahead, step, keep()))
  t_wait = time.perf_counter()
  item = tr.produce(step, head.version, head.problems, ro, head.keep)  # waits for the tokens of step s
  t1 = time.perf_counter()
  row = tr.train_on(item, t0, t1)
  row.update(token_lag_metrics(sh.to_host(item.ro.version_BT), sh.to_host(item.ro.response_mask_BT), step, k))
  # The host's wait for the rest of this step's rollout (the trainer idles meanwhile).
  row["time/sampler_wait_s"] = t1 - t_wait
  row["async/dropped"], row["async/waits"] = 0.0, 1.0
  return row


# -- checkpoint form ----------------------------------------------------------------------------
# `rl.inflight_resume` (docs/architecture.md#in-flight-weight-updates): 'carry' saves a partial
# rollout's whole engine carry (KV cache included) and continues it as it was; 'reprefill' saves its
# progress (`chunked.progress`: no KV cache, nothing its prompts and key derive) and rebuilds the
# cache on resume by prefilling every live slot's prompt and partial response with the sampler's
# weights of the resumed step, the ones its next chunk decodes with.


def _row_shardings(tree: dict, mesh) -> dict:
  """The engine's layout of a progress tree on `mesh`: the leading (row or slot) axis over the batch
  axes (replicated where it does not split, and for scalars)."""
  div = sh.batch_divisor(mesh)
  return jax.tree.map(lambda x: sh.batch_sharding(mesh, x.ndim) if x.ndim and x.shape[0] % div == 0
                      else sh.replicated(mesh), tree)


def to_tree(tr, part: Partial, form: str) -> dict:
  """The partial rollout's arrays, on the trainer's mesh (a checkpoint's items share one device
  set), and its kept params. `form` 'carry': the carry whole (KV cache included; the keys as raw key
  data; None entries dropped), under 'carry'; 'reprefill': its progress, under 'progress', each
  array laid out as the engine lays it out (`_row_shardings`)."""
  keep = {"keep": part.keep} if part.keep is not None else {}
  if form == "reprefill":
    with sh.mesh_context(tr.sampler_mesh):
      prog = tr.programs.sampler.rollout_progress(part.carry)
    prog = {k: v for k, v in prog.items() if v is not None}
    return {"progress": sh.on_mesh(prog, tr.mesh, _row_shardings(prog, tr.mesh)), **keep}
  carry = {k: v for k, v in part.carry.items() if v is not None}
  carry["keys_B"] = jax.random.key_data(carry["keys_B"])
  return {"carry": sh.on_mesh(carry, tr.mesh), **keep}


def from_tree(tr, tree: dict, abstract_carry: dict, step: int, version: int, advanced: int, form: str) -> Partial:
  """A restored partial rollout on the sampler's devices. 'carry': its carry moved back; 'reprefill':
  the carry rebuilt from its progress, the step's prompts and key (`rollout_inputs`), every live
  slot's KV cache re-prefilled by the sampler's current weights (`chunked.resume`)."""
  problems, ids, valid, key = rollout_inputs(tr, step)
  if form == "reprefill":
    abstract = tr.programs.sampler.rollout_progress_shapes(abstract_carry)
    prog = sh.on_mesh(tree["progress"], tr.sampler_mesh)
    prog = {k: prog.get(k) if v is not None else None for k, v in abstract.items()}
    with sh.mesh_context(tr.sampler_mesh):
      carry = tr.programs.sampler.resume_rollout(tr.sampler_state, ids, valid, key, prog)
  else:
    carry = sh.on_mesh(tree["carry"], tr.sampler_mesh)
    carry = {k: carry.get(k) if v is not None else None for k, v in abstract_carry.items()}
    carry["keys_B"] = jax.random.wrap_key_data(carry["keys_B"])
  return Partial(step=step, version=version, problems=problems, carry=carry, advanced=advanced,
                 keep=tree.get("keep"))


def restore_targets(tr, abstract_carry: dict, keep_params: bool, form: str) -> dict:
  """Restore targets of one partial rollout (`to_tree`'s form) and the kept params as the trainer's.
  'carry': the carry replicated over the trainer's devices (moved to the sampler's by `from_tree`;
  the next chunk lays it out as the engine does); 'reprefill': the progress in the engine's layout
  (`_row_shardings`), no KV cache."""
  if form == "reprefill":
    prog = {k: v for k, v in tr.programs.sampler.rollout_progress_shapes(abstract_carry).items() if v is not None}
    tree = {"progress": jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), prog,
                                     _row_shardings(prog, tr.mesh))}
  else:
    rep = sh.replicated(tr.mesh)
    carry = {k: v for k, v in abstract_carry.items() if v is not None}
    carry["keys_B"] = jax.eval_shape(jax.random.key_data, carry["keys_B"])
    tree = {"carry": jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), carry)}
  if keep_params:
    tree["keep"] = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                                tr.state["params"])
  return tree
