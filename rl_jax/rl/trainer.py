"""RL job scheduler: the run's state and step pieces over `StepPrograms`; the sync / async steps in drive_sync / drive_async."""
from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import tqdm

from rl_jax import data as data_lib
from rl_jax import preempt
from rl_jax import rollout as rollout_lib
from rl_jax import sharding as sh
from rl_jax import train_state
from rl_jax import workdir as wd
from rl_jax.checkpoint import Checkpointer
from rl_jax.metrics import MetricsWriter, read_metrics, resolve_wandb_mode
from rl_jax.optim import make_optimizer
from rl_jax.rl import advantages as advantages_lib
from rl_jax.rl import drive_async
from rl_jax.rl import drive_sync
from rl_jax.rl import evaluate as evaluate_lib
from rl_jax.rl import inflight as inflight_lib
from rl_jax.rl import inflight_updates
from rl_jax.rl import mismatch_attribution as attribution_lib
from rl_jax.rl import programs as programs_lib
from rl_jax.rl import resume
from rl_jax.rl import run_state
from rl_jax.rl import source_metrics
from rl_jax.rl import summary as summary_lib
from rl_jax.tasks import build as task_build
# The schema lives in job.py; re-exported so `trainer.RLJob` & co. keep resolving.
from rl_jax.rl.job import RLConfig, RLJob, WarmStartConfig  # noqa: F401
from rl_jax.rl.step import TrainBatch
from rl_jax.rl.warm_start import check_sft_section, warm_start


class RLTrainer:
  """Holds the trainer and sampler state of one RL run; `run()` is the job.

  A scheduler: the step's programs and its batch assembly are `StepPrograms`' (rl/programs.py), the
  sync and async global steps are `drive_sync.step` / `drive_async.step` over the pieces below
  (`rollout`, `produce`, `train_on`, `sync_sampler`), checkpoints are rl/resume.py's, the held-out
  evaluation rl/evaluate.py's and summary.json rl/summary.py's.
  """

  def __init__(self, config: Any, workdir: Any):
    """Validates the whole config, then opens (locks, checks) the workdir, then computes.

    Everything that can be wrong with the config or the workdir fails before the first
    compilation or SFT step: the job schema, the prompts against `sampler.max_prompt_len`, the
    warm start's source (and the SFT job an 'auto' warm start would run), wandb credentials,
    the workdir's lock and its stored config (rl_jax.workdir.RunDir).
    """
    self.config = config
    self.config_dict = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    self.job = job = RLJob.from_config(config)
    # The trainer's mesh and the sampler's: one and the same unless async splits the devices.
    self.mesh, self.sampler_mesh = sh.split_meshes(job.mesh)
    job.check_mesh(self.mesh, self.sampler_mesh)   # a batch that does not split fails before any compute
    self.task = task_build.make_task(job.task)
    job.check_start()
    if job.warm_start.source == "hf":
      from rl_jax.models import hf_stage  # pylint: disable=g-import-not-at-top
      from rl_jax.tasks.hf_tokenizer import HFTokenizer  # pylint: disable=g-import-not-at-top
      # A remote checkpoint is read from a host-local copy (the loader memory-maps it); the stored
      # config keeps the URI the user gave.
      local = hf_stage.local_checkpoint(job.warm_start.path)
      self.job = job = dataclasses.replace(job, warm_start=dataclasses.replace(job.warm_start, path=local))
      self.tok = HFTokenizer.from_dir(local)
    else:
      self.tok = task_build.make_tokenizer(self.task, job.model)
    task_build.bind_task(self.task, self.tok, job.sampler.max_prompt_len)   # a dataset: read, render, filter
    job.check_data(self.task, self.tok)
    if job.warm_start.source == "auto":
      check_sft_section(config, self.task, self.tok)
    # Resolved once here, so 'online' without credentials warns before any compute.
    self.logging_cfg = dataclasses.replace(job.logging,
                                           wandb_mode=resolve_wandb_mode(job.logging.wandb_mode))
    self.run_dir = wd.RunDir.open(workdir, self.config_dict, resume=config.get("resume", "check"),
                                  is_writer=jax.process_index() == 0, defaults=RLJob.schema_defaults())
    self.workdir = self.run_dir.root
    self.ckpt = None
    try:
      self._init_state()
    except BaseException:
      self.close()
      raise

  def _init_state(self) -> None:
    job = self.job
    # The [dispatch, ready] intervals of the sampler's and the trainer's programs (async/*_busy).
    self.busy = inflight_lib.BusyClock()
    self.ckpt = Checkpointer(self.workdir, max_to_keep=job.rl.max_to_keep)
    self.resuming = self.ckpt.latest_step() is not None
    # On resume the checkpoint overwrites everything: skip the (possibly costly) warm start
    # and only build the structure and shardings to restore into.
    self.graphdef, params = (train_state.init_params(job.model, job.seed, self.mesh) if self.resuming
                             else self._warm_start())
    self.optimizer = make_optimizer(job.optim)
    self.state = run_state.init_state(job, params, self.optimizer, self.mesh)
    self.start_step = 0
    meta = {}
    if self.resuming:
      # The newest step that restores; a corrupt newer one is moved aside (Checkpointer.restore).
      self.state, meta, self.start_step = resume.restore(self)
    self.programs = programs_lib.build(
        job, self.mesh, self.graphdef, jax.tree.map(lambda x: x.sharding, self.state["params"]),
        jax.tree.map(lambda x: x.sharding, self.state["opt_state"]), self.optimizer,
        sampler_mesh=self.sampler_mesh)
    self._sampler_shardings = None
    if self.sampler_mesh is not self.mesh:
      self._sampler_shardings = sh.param_shardings(train_state.abstract_state(job.model)[1], self.sampler_mesh)
      if "noise" in self.state:  # fixed for the run: moved to the sampler's devices once
        self._noise_s = sh.on_mesh(self.state["noise"], self.sampler_mesh, self._sampler_shardings)
    self.sync_sampler()
    # Async: the rollouts generated ahead of the step that trains them (rl_jax/rl/inflight.py),
    # restored from the checkpoint on resume, so nothing in flight is lost or trained twice.
    self.queue: collections.deque = collections.deque()
    if self.resuming and meta.get("inflight_steps"):
      self.queue.extend(resume.restore_inflight(self, meta))

  def close(self) -> None:
    """Closes the checkpointer and releases the workdir lock (idempotent; `run()` calls it)."""
    if self.ckpt is not None:
      self.ckpt.close()
      self.ckpt = None
    if hasattr(self.task, "close"):  # a dataset's verifier worker processes
      self.task.close()
    self.run_dir.close()

  def __enter__(self) -> "RLTrainer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # -- set-up ---------------------------------------------------------------------------------

  def _warm_start(self):
    return warm_start(self.job, self.config, str(self.run_dir.path("warm_start")), self.mesh)

  # -- the pieces of one global step ---------------------------------------------------------

  def sync_sampler(self) -> None:
    """Sampler weights = cast(quantize(theta + Delta)) from the last synced trainer params.

    With split devices the params are first copied to the sampler's (dispatched, not waited
    for: the copy reads the params before the next update, which donates them, overwrites them).
    """
    self.sampler_state = self.weights_for_sampler(self.state.get("sampler_src", self.state["params"]))

  def weights_for_sampler(self, src):
    """The sampler's weights from the trainer params `src` (copied to its devices first when split)."""
    t = time.perf_counter()
    if self._sampler_shardings is None:
      return self.busy.track("sampler", self.programs.sampler.sync(src, self.state.get("noise")), t)
    src = sh.on_mesh(src, self.sampler_mesh, self._sampler_shardings)
    with sh.mesh_context(self.sampler_mesh):
      return self.busy.track("sampler", self.programs.sampler.sync(src, getattr(self, "_noise_s", None)), t)

  def prompts(self, step: int, split: str = "train", count: int | None = None, start: int | None = None):
    count = count or self.job.rl.prompts_per_step
    start = step * count if start is None else start
    problems = self.task.make_problems(self.job.seed, split, start, count)
    ids, valid = data_lib.prompt_batch(self.task, self.tok, problems, self.job.sampler.max_prompt_len)
    return problems, ids, valid

  def rollout(self, step: int, weights=None):
    """B prompts x G completions from the sampler; deterministic in (seed, step) and the weights
    (`weights`, default the sampler's own: a dropped rollout's regeneration passes the trainer's).

    Dispatched on the sampler's devices and returned at once (JAX's asynchronous dispatch):
    reading its tokens (`completions`) is what waits for the sampler.
    """
    g = self.job.rl.group_size
    problems, ids, valid = self.prompts(step)
    with sh.mesh_context(self.sampler_mesh):  # eager ops (the repeat, the key) place on the context mesh
      ids, valid = rollout_lib.repeat_prompts((ids, valid), g)
      key = jax.random.fold_in(jax.random.key(self.job.seed), step)
      t = time.perf_counter()
      ro = self.busy.track("sampler", self.programs.sampler.generate(
          self.sampler_state if weights is None else weights, ids, valid, key), t)
    return [p for p in problems for _ in range(g)], ro

  def produce(self, step: int, version: int, problems, ro, old_params=None) -> inflight_lib.InFlight:
    """The rollout of `step` scored on the host and moved to the trainer's devices; with
    `old_params` (the weights of `version`) its p_old forward runs now (`rl.p_old_version`)."""
    generated = ro
    if self.sampler_mesh is not self.mesh:  # first: eager ops below run on the trainer's (context) mesh
      ro = sh.on_mesh(ro, self.mesh)
    rewards, errors = self._score_details(problems, ro)
    self.busy.observed("sampler", generated)  # the host read its tokens: the generation is done
    rl = self.job.rl
    metrics = {}
    if rl.overlong_buffer:   # DAPO's overlong penalty shapes what is optimized; metrics keep the verdicts
      penalty = advantages_lib.overlong_penalty(sh.to_host(ro.lengths_B), self.job.sampler.max_new_tokens,
                                                rl.overlong_buffer, rl.overlong_penalty)
      metrics = {"reward/overlong_penalty": float(penalty.mean()), "reward/task": float(rewards.mean()),
                 "accuracy": float((rewards >= 1.0).mean())}
      verdicts, rewards = rewards, (rewards + penalty).astype(np.float32)
    else:
      verdicts = rewards
    item = inflight_lib.InFlight(step=step, version=version, ro=ro, rewards=rewards)
    item.metrics = metrics
    if hasattr(self.task, "source_of"):  # per data_source rows and the verifier's errors
      lengths, response = sh.to_host(ro.lengths_B), sh.to_host(ro.response_BT)
      trunc = source_metrics.truncated(lengths, response[:, -1], response.shape[1], self.job.sampler.eos_id)
      item.metrics.update(source_metrics.train_metrics([self.task.source_of(p) for p in problems], verdicts,
                                                       errors, lengths, trunc))
    if old_params is not None:
      item.old = self._old_forward(old_params, ro, rewards)
    return item

  def _old_forward(self, params, ro, rewards):
    """`LearnerPrograms.forward_old` of the rollout at `params`, timed on the trainer's busy clock."""
    t = time.perf_counter()
    return self.busy.track("trainer", self.programs.learner.forward_old(
        params, ro, self.programs.learner.advantages(jnp.asarray(rewards))), t)

  def completions(self, ro) -> list[str]:
    """Response texts on the host: the only place tokens leave the device."""
    return data_lib.decode_completions(self.tok, sh.to_host(ro.response_BT))

  def score(self, problems, ro) -> np.ndarray:
    """Task rewards, computed on the host."""
    return self._score_details(problems, ro)[0]

  def _score_details(self, problems, ro) -> tuple[np.ndarray, list[str]]:
    """Rewards and the verifier's error names ('' when correct; [] for a task without verdicts)."""
    texts = self.completions(ro)
    if hasattr(self.task, "score_batch"):  # batched: a dataset's sandboxed verifiers run in parallel
      verdicts = self.task.score_batch(problems, texts)
      rewards = np.asarray([v.reward for v in verdicts], np.float32)
      if jax.process_count() > 1:  # process 0's verdicts for all: a timeout on one host only must not split them
        from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
        rewards = np.asarray(multihost_utils.broadcast_one_to_all(rewards), np.float32)
      return rewards, [v.error for v in verdicts]
    return np.asarray([self.task.reward(p, t) for p, t in zip(problems, texts)], np.float32), []

  def prepare(self, ro: rollout_lib.Rollout, rewards: np.ndarray, old=None) -> tuple[TrainBatch, dict]:
    """Advantages, the theta_old forward and the replay routes of this global step.

    `old`: the p_old forward's outputs when they were computed at the rollout's version
    (`produce`); None runs it here at the policy `rl.p_old_version` names, or leaves it to the
    update's own forward where that is the same (`RLJob.old_in_update`).
    """
    if old is None and not self.programs.learner.old_in_update:
      old = self._old_forward(self._p_old_params(), ro, rewards)
    return self.programs.learner.prepare(None, ro, self.programs.learner.advantages(jnp.asarray(rewards)), old)

  def _p_old_params(self):
    """The weights of the sync loop's p_old forward (emulated staleness: the rollout's version is
    the last synced params)."""
    if self.job.rl.p_old_version == "rollout" and "sampler_src" in self.state:
      return self.state["sampler_src"]
    return self.state["params"]

  def attribute(self, ro: rollout_lib.Rollout) -> dict:
    """`attribution/*` of `rl.attribution_rows` rows of `ro`, strided over its prompts
    (rl_jax/rl/mismatch_attribution.py), with the call's time; fetched to the host, so it has finished
    reading the params before an update donates them."""
    n = self.job.rl.attribution_rows
    stride = ro.tokens_BS.shape[0] // n
    sub = jax.tree.map(lambda x: x[::stride][:n], ro)
    stale = self.state["sampler_src"] if programs_lib.attribution_stale(self.job) else None
    t0 = time.perf_counter()
    out = self.busy.track("trainer", self.programs.learner.attribution(
        self._p_old_params(), stale, self.state.get("noise"), sub), t0)
    raw = sh.to_host(out)
    self.busy.observed("trainer", out)
    m = attribution_lib.contributions(raw)
    m["time/attribution_s"] = time.perf_counter() - t0
    return m

  def minibatches(self, batch: TrainBatch):
    """The step's group-aligned mini-batches (`LearnerPrograms.minibatches`)."""
    return self.programs.learner.minibatches(batch)

  def update(self, batch: TrainBatch, step: int) -> dict:
    """N optimizer updates on group-aligned mini-batches; raises on a non-finite step."""
    metrics = []
    for i, mb in enumerate(self.minibatches(batch)):
      t = time.perf_counter()
      # Watched through its metrics (never donated; every output of the update is ready together).
      params, opt_state, m = self.programs.learner.update(self.state["params"], self.state["opt_state"], mb)
      self.busy.track("trainer", m, t)
      # Params were donated: keep the returned ones (unchanged when the step was not finite).
      self.state["params"], self.state["opt_state"] = params, opt_state
      m_dev = m
      m = sh.to_host(m)
      self.busy.observed("trainer", m_dev)
      if not bool(m["finite"]):
        raise FloatingPointError(
            f"non-finite loss or gradient at RL step {step + 1}, mini-batch {i} (loss={m['loss']}, "
            f"grad_norm={m['grad_norm']}); the update was not applied and nothing was saved. "
            f"Last good checkpoint: step {self.ckpt.latest_step()} in {self.ckpt.directory}")
      metrics.append(m)
    out = {k: float(np.mean([m[k] for m in metrics])) for k in metrics[0] if k != "finite"}
    return out

  def train_step(self, step: int) -> dict:
    """One global step; returns its metrics (docs/metrics.md), with the device groups' busy
    fractions over the step's wall time (`async/*_busy`, inflight.BusyClock)."""
    self.busy.reset()
    start = time.perf_counter()
    if self.job.rl.inflight_updates:  # async, the rollouts generated in chunks across versions
      row = inflight_updates.async_step(self, step)
    elif self.job.rl.mode == "async" and self.job.rl.max_staleness > 0:
      row = drive_async.step(self, step)
    else:
      row = drive_sync.step(self, step)
    row.update(self.busy.fractions(start, time.perf_counter()))
    return row

  def train_on(self, item: inflight_lib.InFlight, t0: float, t1: float) -> dict:
    """p_old, the meter and the N updates of `item`'s step (the drivers' common part); its metrics
    row (`t0` / `t1`: when its generation was dispatched / scored)."""
    step, ro, rewards = item.step, item.ro, item.rewards
    batch, m_dev = self.prepare(ro, rewards, item.old)
    m_old = sh.to_host(m_dev)
    self.busy.observed("trainer", m_dev)
    t2 = time.perf_counter()
    meter_every = self.job.rl.meter_every
    m_first = {}
    if meter_every and (step + 1) % meter_every == 0:
      # On the first mini-batch at theta_old, before its update (which donates the params):
      # fetched to the host here, so the meter has finished reading them.
      t = time.perf_counter()
      fo = self.busy.track("trainer", self.programs.learner.first_order(self.state["params"],
                                                                next(self.minibatches(batch))), t)
      m_first = {f"first_order/{k}": float(v) for k, v in sh.to_host(fo).items()}
      self.busy.observed("trainer", fo)
    every = self.job.rl.attribution_every
    m_attr = self.attribute(ro) if every and (step + 1) % every == 0 else {}
    m_upd = self.update(batch, step)
    t3 = time.perf_counter()
    # Batch-sharded arrays: on a multi-host mesh each process holds only its rows.
    lengths = sh.to_host(ro.lengths_B)
    head = sh.to_host(ro.head_mass_BT)
    mask = sh.to_host(ro.response_mask_BT)
    row = {"reward": float(rewards.mean()), "accuracy": float((rewards >= 1.0).mean()),
           "response_length": float(lengths.mean()),
           **{k: float(v) for k, v in m_old.items()},
           # The drift meters (present when the sampler recorded its top-k) are logged top-level, and
           # so are p_old's mismatch metrics when the update computed p_old (`old_in_update`).
           **{k if k.startswith(("drift/", "mismatch/")) else f"loss/{k}": v for k, v in m_upd.items()},
           "p_old/in_update": float(batch.old_in_update),
           **m_first, **m_attr,
           "time/sample_s": t1 - t0, "time/p_old_s": t2 - t1, "time/update_s": t3 - t2,
           "async/lag": float(item.lag), **item.metrics}
    if hasattr(self.task, "data_state"):  # train prompts and epochs consumed after this step
      state = self.task.data_state((step + 1) * self.job.rl.prompts_per_step)
      row["data/consumed"], row["data/epoch"] = float(state["consumed"]), state["epoch"]
      row.update(self.task.stats())   # prompts kept and dropped as longer than sampler.max_prompt_len
    if mask.any():  # the sampler's top-k mass (its top-1 mass when record_topk = 0: a floor)
      row["mismatch/head_mass_mean"] = float(np.asarray(head)[mask].mean())
      row["mismatch/head_mass_min"] = float(np.asarray(head)[mask].min())
    return row

  def evaluate(self) -> dict:
    """Held-out greedy accuracy, sampled mean@k and pass@k; clean fp32 weights (no quant, noise).
    Nothing for a task without eval problems (a dataset without task.eval_files) or at rl.eval_size=0."""
    if not self.job.rl.eval_size or not task_build.has_eval(self.task):
      return {}
    n, k = self.job.rl.eval_size, self.job.rl.eval_samples
    problems, ids, valid = self.prompts(0, split="eval", count=n, start=0)
    clean = self.programs.sampler.clean_weights(self.state["params"])
    key = jax.random.fold_in(jax.random.key(self.job.seed), 0xE7A1)
    return evaluate_lib.evaluate(self.task, self.score, self.completions, self.programs.sampler.generate, clean, ids,
                                 valid, problems, key, k, eos_id=self.job.sampler.eos_id)

  def save(self, step: int) -> None:
    """The state at `step` and, async, the rollouts in flight (generated, not yet trained on)."""
    resume.save(self, step)

  # -- the job ---------------------------------------------------------------------------------

  def run(self) -> dict:
    """The loop from `start_step` to `rl.steps`; closes the trainer (and its lock) when done.

    SIGTERM / SIGINT (a preemption) end it after the step in progress with a checkpoint of that
    step: `preempt.Preempted` is raised (the entry point exits with code 75).
    """
    with sh.mesh_context(self.mesh), preempt.Guard() as guard:
      return self._run(guard)

  def _run(self, guard: preempt.Guard) -> dict:
    job = self.job
    writer = None
    bar = None
    try:
      # A resumed run drops the metrics rows after the restored step (a killed attempt's), a fresh
      # one every row: each step is written once.
      writer = MetricsWriter(self.workdir, self.logging_cfg, self.config_dict,
                             run_id=self.run_dir.run_id,
                             restored_step=self.start_step if self.resuming else None)
      if self.start_step == 0:
        writer.write(0, {"step": 0, **self.evaluate()})
      bar = tqdm.tqdm(range(self.start_step, job.rl.steps), initial=self.start_step,
                      total=job.rl.steps, desc="rl", disable=jax.process_index() != 0,
                      mininterval=2.0)
      for step in bar:
        row = self.train_step(step)
        done = step + 1
        if done % job.rl.eval_every == 0 or done == job.rl.steps:
          row.update(self.evaluate())
        writer.write(done, row)
        bar.set_postfix(reward=f"{row['reward']:.3f}", kl=f"{row['mismatch/kl_k1']:.2e}")
        stop = done < job.rl.steps and guard.stop_requested()  # SIGTERM / SIGINT: checkpoint, exit
        if stop or done % job.rl.checkpoint_every == 0 or done == job.rl.steps:
          self.save(done)
        if stop:
          self.ckpt.wait_until_finished()
          raise preempt.Preempted(done, guard.signum, self.ckpt.directory)
      # The final checkpoint is on disk (its async write finished, or raised) before summary.json
      # marks the run done; inside the lock: nobody else writes this workdir while the summary is.
      self.ckpt.wait_until_finished()
      return self.summarize()
    finally:
      if bar is not None:
        bar.close()
      if writer is not None:
        writer.close()
      self.close()

  def summarize(self) -> dict:
    """summary.json (and rl_curves.png) from metrics.jsonl (rl_jax/rl/summary.py)."""
    return summary_lib.write(self.run_dir, read_metrics(self.workdir), self.job.rl.plot)


def run(config: Any, workdir: Any) -> dict:
  return RLTrainer(config, workdir).run()
