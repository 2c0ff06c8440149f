"""RL job loop: sample, score, p_old forward, N updates, sync; the pieces live in job/step/evaluate/warm_start."""
from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import tqdm

from rl_jax import data as data_lib
from rl_jax import experiment as ex
from rl_jax import rollout as rollout_lib
from rl_jax import sharding as sh
from rl_jax.checkpoint import Checkpointer
from rl_jax.config_utils import ConfigError, require
from rl_jax import workdir as wd
from rl_jax.metrics import MetricsWriter, read_metrics, resolve_wandb_mode
from rl_jax.optim import make_optimizer
from rl_jax.rl import evaluate as evaluate_lib
from rl_jax.rl import programs as programs_lib
from rl_jax.rl import plots
# The schema lives in job.py; re-exported so `trainer.RLJob` & co. keep resolving.
from rl_jax.rl.job import RLConfig, RLJob, WarmStartConfig  # noqa: F401
from rl_jax.rl.step import TrainBatch
from rl_jax.rl.warm_start import check_sft_section, check_sft_warm_start, warm_start
from rl_jax.sampler import weights as sampler_weights


# How many steps' train prompts `_check_prompts` tokenizes before any compute (the whole eval set too).
PROMPT_CHECK_STEPS = 64


def _check_dir(path: str, key: str, needs: str) -> None:
  """A warm-start directory that must exist and hold `needs` (read-only: nothing is created)."""
  root = wd.as_path(path, key)
  if not (root / needs).exists():
    raise ConfigError(f"config key '{key}': {root} has no {needs} (a typo?)")


class RLTrainer:
  """Holds the trainer and sampler state of one RL run; `run()` is the job."""

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
    self.mesh = sh.make_mesh(job.mesh)
    b, g, n = job.rl.prompts_per_step, job.rl.group_size, job.rl.n_minibatches
    div = sh.batch_divisor(self.mesh)
    if (b // n) * g % div:
      raise ConfigError(f"config key 'rl.prompts_per_step': mini-batches of {(b // n) * g} "
                        f"responses do not split over the mesh's batch axes ({div})")
    ex.check_batch(job.rl.eval_size, "rl.eval_size", self.mesh)
    programs_lib.microbatch_counts(job, self.mesh)   # a bad micro-batch split fails before any compute
    self.task = ex.make_task(job.task)
    # Checked here, not in RLJob: configs ship with the path left for the command line.
    require(job.warm_start.source not in ("hf", "sft") or bool(job.warm_start.path), "warm_start.path",
            f"empty: warm_start.source={job.warm_start.source!r} needs the checkpoint directory "
            "to start from (--config.warm_start.path=...)")
    if job.warm_start.source == "hf":
      _check_dir(job.warm_start.path, "warm_start.path", "config.json")
      from rl_jax.models import hf_stage  # pylint: disable=g-import-not-at-top
      from rl_jax.tasks.hf_tokenizer import HFTokenizer  # pylint: disable=g-import-not-at-top
      # A remote checkpoint is read from a host-local copy (the loader memory-maps it); the stored
      # config keeps the URI the user gave.
      local = hf_stage.local_checkpoint(job.warm_start.path)
      self.job = job = dataclasses.replace(job, warm_start=dataclasses.replace(job.warm_start, path=local))
      self.tok = HFTokenizer.from_dir(local)
    else:
      self.tok = ex.make_tokenizer(self.task, job.model)
    self._check_tokens()
    self._check_prompts()
    if job.warm_start.source == "sft":
      check_sft_warm_start(job.warm_start.path)
    elif job.warm_start.source == "auto":
      check_sft_section(config, self.task, self.tok)
    # Resolved once here, so 'online' without credentials warns before any compute.
    self.logging_cfg = dataclasses.replace(job.logging,
                                           wandb_mode=resolve_wandb_mode(job.logging.wandb_mode))
    self.run_dir = wd.RunDir.open(workdir, self.config_dict, resume=config.get("resume", "check"),
                                  is_writer=jax.process_index() == 0)
    self.workdir = self.run_dir.root
    self.ckpt = None
    try:
      self._init_state()
    except BaseException:
      self.close()
      raise

  def _init_state(self) -> None:
    job = self.job
    self.ckpt = Checkpointer(self.workdir, max_to_keep=job.rl.max_to_keep)
    self.resuming = self.ckpt.latest_step() is not None
    # On resume the checkpoint overwrites everything: skip the (possibly costly) warm start
    # and only build the structure and shardings to restore into.
    self.graphdef, params = (ex.init_params(job.model, job.seed, self.mesh) if self.resuming
                             else self._warm_start())
    self.optimizer = make_optimizer(job.optim)
    opt_state = ex.init_opt_state(self.optimizer, params, self.mesh)
    noise_key = jax.random.fold_in(jax.random.key(job.seed), 0x5E5)
    delta = sampler_weights.make_noise(params, job.sampler.noise, job.sampler.noise_sigma, noise_key)
    # The sampler refreshes from `sampler_src` (the trainer's params at the last sync).
    self.state = {"params": params, "opt_state": opt_state}
    if delta is not None:
      self.state["noise"] = delta
    if job.rl.staleness > 1:
      # A copy: the trainer's params are donated to every update.
      self.state["sampler_src"] = jax.tree.map(jnp.copy, params)
    self.start_step = 0
    if self.resuming:
      # The newest step that restores; a corrupt newer one is moved aside (Checkpointer.restore).
      self.state, _, self.start_step = self.ckpt.restore(self.state)
      print(f"[rl] resumed from step {self.start_step} in {self.ckpt.directory}")
    self.programs = programs_lib.build(
        job, self.mesh, self.graphdef, jax.tree.map(lambda x: x.sharding, self.state["params"]),
        jax.tree.map(lambda x: x.sharding, self.state["opt_state"]), self.optimizer)
    self.sync_sampler()

  def close(self) -> None:
    """Closes the checkpointer and releases the workdir lock (idempotent; `run()` calls it)."""
    if self.ckpt is not None:
      self.ckpt.close()
      self.ckpt = None
    self.run_dir.close()

  def __enter__(self) -> "RLTrainer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # -- set-up ---------------------------------------------------------------------------------

  def _check_tokens(self) -> None:
    s = self.job.sampler
    for key, want in (("eos_id", self.tok.eos_id), ("pad_id", self.tok.pad_id)):
      require(getattr(s, key) == want, f"sampler.{key}",
              f"{getattr(s, key)} differs from the tokenizer's {key} {want}")

  def _check_prompts(self) -> None:
    """Every prompt the run will see fits `sampler.max_prompt_len` (the train prompts of the first
    steps and the whole eval set: host-side tokenization only, no compute)."""
    rl, limit = self.job.rl, self.job.sampler.max_prompt_len
    count = min(rl.steps, PROMPT_CHECK_STEPS) * rl.prompts_per_step
    for split, n in (("train", count), ("eval", rl.eval_size)):
      problems = self.task.make_problems(self.job.seed, split, 0, n)
      longest = max(problems, key=lambda p: len(data_lib.prompt_ids(self.task, self.tok, p)))
      length = len(data_lib.prompt_ids(self.task, self.tok, longest))
      require(length <= limit, "sampler.max_prompt_len",
              f"{limit} is shorter than a {split} prompt of {length} tokens "
              f"({self.task.prompt(longest)!r}); set it to at least {length}")

  def _warm_start(self):
    return warm_start(self.job, self.config, str(self.run_dir.path("warm_start")), self.mesh)

  # -- the pieces of one global step ---------------------------------------------------------

  def sync_sampler(self) -> None:
    """Sampler weights = cast(quantize(theta + Delta)) from the last synced trainer params."""
    src = self.state.get("sampler_src", self.state["params"])
    self.sampler_state = self.programs.sync(src, self.state.get("noise"))

  def prompts(self, step: int, split: str = "train", count: int | None = None, start: int | None = None):
    count = count or self.job.rl.prompts_per_step
    start = step * count if start is None else start
    problems = self.task.make_problems(self.job.seed, split, start, count)
    ids, valid = data_lib.prompt_batch(self.task, self.tok, problems, self.job.sampler.max_prompt_len)
    return problems, ids, valid

  def rollout(self, step: int):
    """B prompts x G completions from the sampler; deterministic in (seed, step)."""
    g = self.job.rl.group_size
    problems, ids, valid = self.prompts(step)
    ids, valid = rollout_lib.repeat_prompts((ids, valid), g)
    key = jax.random.fold_in(jax.random.key(self.job.seed), step)
    ro = self.programs.generate(self.sampler_state, ids, valid, key)
    return [p for p in problems for _ in range(g)], ro

  def completions(self, ro) -> list[str]:
    """Response texts on the host: the only place tokens leave the device."""
    return data_lib.decode_completions(self.tok, sh.to_host(ro.response_BT))

  def score(self, problems, ro) -> np.ndarray:
    """Task rewards, computed on the host."""
    return np.asarray([self.task.reward(p, t) for p, t in zip(problems, self.completions(ro))],
                      np.float32)

  def prepare(self, ro: rollout_lib.Rollout, rewards: np.ndarray) -> tuple[TrainBatch, dict]:
    """Advantages, the theta_old forward and the replay routes of this global step."""
    # The sampler's top-k rides along whenever it was recorded: the loss's drift meter reads it
    # (K more gathered ids per token), score centering too.
    batch = TrainBatch.from_rollout(ro, self.programs.advantages(jnp.asarray(rewards)), with_topk=True)
    sampler_ids = ro.expert_ids_BSLK if self.job.model.is_moe else None
    logp_old, own_ids, m = self.programs.old_forward(self.state["params"], batch, sampler_ids,
                                                     ro.expert_valid_BS)
    batch = batch.replace(logp_old_BT=logp_old)
    replay = self.job.rl.routing_replay
    if replay == "R2":
      batch = batch.replace(replay_ids_BSLK=own_ids, replay_mask_BS=batch.valid_BS)
    elif replay == "R3":
      batch = batch.replace(replay_ids_BSLK=ro.expert_ids_BSLK, replay_mask_BS=ro.expert_valid_BS)
    return batch, m

  def minibatches(self, batch: TrainBatch):
    n = self.job.rl.n_minibatches
    rows = batch.rows // n
    for i in range(n):
      yield batch.slice_rows(i * rows, (i + 1) * rows)

  def update(self, batch: TrainBatch, step: int) -> dict:
    """N optimizer updates on group-aligned mini-batches; raises on a non-finite step."""
    metrics = []
    for i, mb in enumerate(self.minibatches(batch)):
      params, opt_state, m = self.programs.update(self.state["params"], self.state["opt_state"], mb)
      # Params were donated: keep the returned ones (unchanged when the step was not finite).
      self.state["params"], self.state["opt_state"] = params, opt_state
      m = sh.to_host(m)
      if not bool(m["finite"]):
        raise FloatingPointError(
            f"non-finite loss or gradient at RL step {step + 1}, mini-batch {i} (loss={m['loss']}, "
            f"grad_norm={m['grad_norm']}); the update was not applied and nothing was saved. "
            f"Last good checkpoint: step {self.ckpt.latest_step()} in {self.ckpt.directory}")
      metrics.append(m)
    out = {k: float(np.mean([m[k] for m in metrics])) for k in metrics[0] if k != "finite"}
    return out

  def train_step(self, step: int) -> dict:
    """One global step; returns its metrics (docs/metrics.md)."""
    t0 = time.perf_counter()
    problems, ro = self.rollout(step)
    rewards = self.score(problems, ro)
    t1 = time.perf_counter()
    batch, m_old = self.prepare(ro, rewards)
    m_old = sh.to_host(m_old)
    t2 = time.perf_counter()
    meter_every = self.job.rl.meter_every
    m_first = {}
    if meter_every and (step + 1) % meter_every == 0:
      # On the first mini-batch at theta_old, before its update (which donates the params):
      # fetched to the host here, so the meter has finished reading them.
      fo = self.programs.first_order(self.state["params"], next(self.minibatches(batch)))
      m_first = {f"first_order/{k}": float(v) for k, v in sh.to_host(fo).items()}
    m_upd = self.update(batch, step)
    t3 = time.perf_counter()
    done = step + 1
    if done % self.job.rl.staleness == 0:
      if "sampler_src" in self.state:
        self.state["sampler_src"] = jax.tree.map(jnp.copy, self.state["params"])
      self.sync_sampler()
      jax.block_until_ready(self.sampler_state)
    t4 = time.perf_counter()
    # Batch-sharded arrays: on a multi-host mesh each process holds only its rows.
    lengths = sh.to_host(ro.lengths_B)
    head = sh.to_host(ro.head_mass_BT)
    mask = sh.to_host(ro.response_mask_BT)
    row = {"reward": float(rewards.mean()), "accuracy": float((rewards >= 1.0).mean()),
           "response_length": float(lengths.mean()),
           **{k: float(v) for k, v in m_old.items()},
           # The drift meters (present when the sampler recorded its top-k) are logged top-level.
           **{k if k.startswith("drift/") else f"loss/{k}": v for k, v in m_upd.items()},
           **m_first,
           "time/sample_s": t1 - t0, "time/p_old_s": t2 - t1, "time/update_s": t3 - t2,
           "time/sync_s": t4 - t3}
    if mask.any():  # the sampler's top-k mass (its top-1 mass when record_topk = 0: a floor)
      row["mismatch/head_mass_mean"] = float(np.asarray(head)[mask].mean())
      row["mismatch/head_mass_min"] = float(np.asarray(head)[mask].min())
    return row

  def evaluate(self) -> dict:
    """Held-out greedy accuracy, sampled mean@k and pass@k; clean fp32 weights (no quant, noise)."""
    n, k = self.job.rl.eval_size, self.job.rl.eval_samples
    problems, ids, valid = self.prompts(0, split="eval", count=n, start=0)
    clean = self.programs.clean_weights(self.state["params"])
    key = jax.random.fold_in(jax.random.key(self.job.seed), 0xE7A1)
    return evaluate_lib.evaluate(self.task, self.score, self.completions, self.programs.generate, clean, ids,
                                 valid, problems, key, k)

  def save(self, step: int) -> None:
    self.ckpt.save(step, self.state, {"step": step, "seed": self.job.seed, "job": "rl"})

  # -- the job ---------------------------------------------------------------------------------

  def run(self) -> dict:
    """The loop from `start_step` to `rl.steps`; closes the trainer (and its lock) when done."""
    with sh.mesh_context(self.mesh):
      return self._run()

  def _run(self) -> dict:
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
        if done % job.rl.checkpoint_every == 0 or done == job.rl.steps:
          self.save(done)
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
    """summary.json from metrics.jsonl (each step once, so means are over the run's steps)."""
    rows = read_metrics(self.workdir)
    evals = [r for r in rows if "eval_greedy_accuracy" in r]
    summary = {}
    for name in ("greedy_accuracy", "sampled_accuracy", "pass_at_k"):
      have = [r[f"eval_{name}"] for r in evals if f"eval_{name}" in r]
      if have:  # the first eval is the warm start's (step 0)
        summary.update({f"start_eval_{name}": have[0], f"final_eval_{name}": have[-1],
                        f"gain_eval_{name}": have[-1] - have[0]})
    train = [r for r in rows if "reward" in r]
    if train:
      summary.update(final_reward=train[-1]["reward"], mean_kl_k1=float(np.mean([r["mismatch/kl_k1"] for r in train])),
                     steps=train[-1]["step"])
    if jax.process_index() == 0:
      self.run_dir.path("summary.json").write_text(json.dumps(summary, indent=1))
      if self.job.rl.plot and rows:
        plots.plot_run(rows, self.run_dir.path("rl_curves.png"))
      print("[rl] " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                for k, v in summary.items()))
    return summary


def run(config: Any, workdir: Any) -> dict:
  return RLTrainer(config, workdir).run()
