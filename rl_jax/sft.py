"""SFT job: next-token training on generated task solutions; the cold start for RL."""
from __future__ import annotations

import dataclasses
import functools
import json
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import tqdm
from flax import nnx

from rl_jax import artifacts
from rl_jax import data as data_lib
from rl_jax import job_sections
from rl_jax import preempt
from rl_jax import sharding as sh
from rl_jax import train_state
from rl_jax import workdir as wd
from rl_jax.checkpoint import Checkpointer
from rl_jax.config_utils import flat_defaults, require
from rl_jax.logprobs import token_logprobs
from rl_jax.metrics import LoggingConfig, MetricsWriter, resolve_wandb_mode
from rl_jax.models import ModelConfig
from rl_jax.models.decode import greedy_reference
from rl_jax.optim import OptimConfig, make_optimizer
from rl_jax.tasks import build as task_build


@dataclasses.dataclass(frozen=True)
class SFTConfig:
  steps: int = 1000
  batch_size: int = 64
  max_len: int = 40             # tokens per sequence (prompt + completion + eos)
  eval_every: int = 250
  eval_size: int = 128
  eval_max_new_tokens: int = 16
  checkpoint_every: int = 250
  max_to_keep: int = 2

  def __post_init__(self):
    for k in ("steps", "batch_size", "max_len", "eval_every", "eval_size", "checkpoint_every"):
      require(getattr(self, k) > 0, f"sft.{k}", f"must be > 0, got {getattr(self, k)}")


# `resume`: optional, "check" or "force" (rl_jax.workdir.RunDir).
TOP_LEVEL = {"job", "seed", "task", "model", "mesh", "optim", "sft", "logging", "resume"}


def sections() -> dict[str, type]:
  """Section name -> config dataclass of an SFT job (config_schema's source for 'sft')."""
  return {"task": task_build.TaskConfig, "model": ModelConfig, "mesh": sh.MeshConfig, "optim": OptimConfig,
          "logging": LoggingConfig, "sft": SFTConfig}


# How many steps' batches `SFTJob.check_data` tokenizes before any compute.
MAX_LEN_CHECK_STEPS = 64


@dataclasses.dataclass(frozen=True)
class SFTJob:
  seed: int
  task: task_build.TaskConfig
  model: ModelConfig
  mesh: sh.MeshConfig
  optim: OptimConfig
  sft: SFTConfig
  logging: LoggingConfig

  @classmethod
  def from_config(cls, config: Any) -> "SFTJob":
    job_sections.check_top_level(config, TOP_LEVEL)
    return cls(seed=int(config.get("seed", 0)),
               task=job_sections.section(config, "task", task_build.TaskConfig),
               model=job_sections.section(config, "model", ModelConfig),
               mesh=job_sections.section(config, "mesh", sh.MeshConfig),
               optim=job_sections.section(config, "optim", OptimConfig),
               sft=job_sections.section(config, "sft", SFTConfig),
               logging=job_sections.section(config, "logging", LoggingConfig))

  # The job's cross-field checks, each run once before any compute (`validate`): against the
  # devices' mesh and against the tokenized task.

  def check_mesh(self, mesh) -> None:
    """The batch splits over the mesh's batch axes."""
    job_sections.check_batch(self.sft.batch_size, "sft.batch_size", mesh)

  def check_data(self, task, tok) -> None:
    """`sft.max_len` fits the sequences of the first steps' batches (host-side tokenization only)."""
    s = self.sft
    problems = task.make_problems(self.seed, "train", 0, min(s.steps, MAX_LEN_CHECK_STEPS) * s.batch_size)
    seq = lambda p: len(data_lib.prompt_ids(task, tok, p)) + len(tok.encode(task.completion(p)))
    longest = max(problems, key=seq)
    # prompt + completion + eos is max_len + 1 tokens at most (inputs and targets overlap by all but one).
    require(seq(longest) <= s.max_len, "sft.max_len",
            f"{s.max_len} is too short for a training sequence of {seq(longest)} tokens (prompt + "
            f"completion; {task.prompt(longest)!r}); set it to at least {seq(longest)}")


def nll_loss(graphdef, params, batch, aux_coef: float):
  """Mean next-token NLL over loss-masked targets (+ the MoE load-balancing loss)."""
  out = nnx.merge(graphdef, params)(batch["inputs_BT"], valid_BS=batch["valid_BT"])
  logp_BT = token_logprobs(out.logits_BSV, batch["targets_BT"])
  mask = batch["loss_mask_BT"].astype(jnp.float32)
  nll = -jnp.sum(logp_BT * mask) / jnp.maximum(jnp.sum(mask), 1.0)
  return nll + aux_coef * out.aux_loss, {"nll": nll, "aux_loss": out.aux_loss}


def make_train_step(graphdef, optimizer, aux_coef: float):
  """One optimizer step; a non-finite loss or gradient leaves params and state unchanged."""
  def step(params, opt_state, batch):
    (loss, aux), grads = jax.value_and_grad(
        functools.partial(nll_loss, graphdef, batch=batch, aux_coef=aux_coef), has_aux=True)(params)
    gnorm = optax.global_norm(grads)
    ok = jnp.isfinite(loss) & jnp.isfinite(gnorm)
    updates, new_opt = optimizer.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
    return keep(new_params, params), keep(new_opt, opt_state), {
        "loss": loss, **aux, "grad_norm": gnorm, "finite": ok}
  return step


def evaluate(job_task, tok, graphdef, params, seed: int, n: int, max_new: int, batch: int = 128):
  """Held-out greedy accuracy on the first `n` eval problems (reference decode loop)."""
  problems = job_task.make_problems(seed, "eval", 0, n)
  max_prompt = max(len(data_lib.prompt_ids(job_task, tok, p)) for p in problems)
  model = nnx.merge(graphdef, params)
  rewards = []
  for i in range(0, n, batch):
    chunk = problems[i:i + batch]
    ids, valid = data_lib.prompt_batch(job_task, tok, chunk, max_prompt)
    out = greedy_reference(model, ids, valid, max_new, eos_id=tok.eos_id, pad_id=tok.pad_id)
    texts = data_lib.decode_completions(tok, out)
    rewards += [job_task.reward(p, t) for p, t in zip(chunk, texts)]
  return float(np.mean(rewards))


def validate(config: Any):
  """(job, mesh, task, tok): every config check of the SFT job, before any compute."""
  job = SFTJob.from_config(config)
  mesh = sh.make_mesh(job.mesh)
  job.check_mesh(mesh)
  task = task_build.make_task(job.task)
  tok = task_build.make_tokenizer(task, job.model)
  task_build.bind_task(task, tok, job.sft.max_len)
  job.check_data(task, tok)
  return job, mesh, task, tok


def run(config: Any, workdir: Any) -> dict:
  """Runs (or resumes) SFT in `workdir` (local or remote); returns the final metrics."""
  job, mesh, task, tok = validate(config)
  with sh.mesh_context(mesh), preempt.Guard() as guard:
    return _run(config, workdir, job, mesh, task, tok, guard)


def _run(config: Any, workdir: Any, job, mesh, task, tok, guard: preempt.Guard) -> dict:
  logging_cfg = dataclasses.replace(job.logging, wandb_mode=resolve_wandb_mode(job.logging.wandb_mode))
  config_dict = config.to_dict() if hasattr(config, "to_dict") else dict(config)
  run_dir = wd.RunDir.open(workdir, config_dict, resume=config.get("resume", "check"),
                           is_writer=jax.process_index() == 0, defaults=flat_defaults(sections()))
  ckpt = writer = bar = None
  try:
    graphdef, params = train_state.init_params(job.model, job.seed, mesh)
    optimizer = make_optimizer(job.optim)
    opt_state = train_state.init_opt_state(optimizer, params, mesh)
    ckpt = Checkpointer(run_dir.root, max_to_keep=job.sft.max_to_keep)
    start = 0
    resuming = ckpt.latest_step() is not None
    if resuming:
      items, _, start = ckpt.restore({"params": params, "opt_state": opt_state})
      params, opt_state = items["params"], items["opt_state"]
      print(f"[sft] resumed from step {start} in {ckpt.directory}")

    param_sh = jax.tree.map(lambda x: x.sharding, params)
    opt_sh = jax.tree.map(lambda x: x.sharding, opt_state)
    batch_sh = sh.batch_sharding(mesh)
    train_step = jax.jit(make_train_step(graphdef, optimizer, job.model.router_aux_loss_coef),
                         in_shardings=(param_sh, opt_sh, batch_sh),
                         out_shardings=(param_sh, opt_sh, sh.replicated(mesh)),
                         donate_argnums=(0, 1))
    # A resumed run drops the rows after the restored step (a killed attempt's): each step once.
    writer = MetricsWriter(run_dir.root, logging_cfg, config_dict, run_id=run_dir.run_id,
                           restored_step=start if resuming else None)
    s = job.sft
    final: dict = {}
    t0 = time.time()
    bar = tqdm.tqdm(range(start, s.steps), initial=start, total=s.steps, desc="sft",
                    disable=jax.process_index() != 0, mininterval=2.0)
    for step in bar:
      problems = task.make_problems(job.seed, "train", step * s.batch_size, s.batch_size)
      batch = sh.host_to_global(data_lib.sft_batch(task, tok, problems, s.max_len), mesh)
      params, opt_state, m = train_step(params, opt_state, batch)
      m = jax.device_get(m)
      if not bool(m["finite"]):
        raise FloatingPointError(
            f"non-finite loss/gradient at SFT step {step + 1} (loss={m['loss']}, grad_norm="
            f"{m['grad_norm']}); the update was not applied and nothing was saved. Last good "
            f"checkpoint: step {ckpt.latest_step()} in {ckpt.directory}")
      done = step + 1
      row = {"loss": m["loss"], "nll": m["nll"], "grad_norm": m["grad_norm"], "aux_loss": m["aux_loss"],
             "time_s": time.time() - t0}
      if (done % s.eval_every == 0 or done == s.steps) and task_build.has_eval(task):
        row["eval_accuracy"] = evaluate(task, tok, graphdef, params, job.seed, s.eval_size,
                                        s.eval_max_new_tokens)
        bar.set_postfix(loss=f"{float(m['loss']):.3f}", acc=f"{row['eval_accuracy']:.3f}")
      writer.write(done, row)
      final = row
      stop = done < s.steps and guard.stop_requested()  # SIGTERM / SIGINT: checkpoint, then exit
      if stop or done % s.checkpoint_every == 0 or done == s.steps:
        ckpt.save(done, {"params": params, "opt_state": opt_state}, {"step": done, "job": "sft"})
      if stop:
        ckpt.wait_until_finished()
        raise preempt.Preempted(done, guard.signum, ckpt.directory)
    ckpt.wait_until_finished()  # the final checkpoint is on disk before summary.json says done
    if jax.process_index() == 0 and final:
      summary = {k: float(v) for k, v in final.items()}
      run_dir.path(artifacts.SUMMARY).write_text(json.dumps(summary, indent=1))
      print(f"[sft] done: step {s.steps}, loss {summary['loss']:.4f}, "
            f"eval_accuracy {summary.get('eval_accuracy', float('nan')):.3f}")
    return final
  finally:
    if bar is not None:
      bar.close()
    if writer is not None:
      writer.close()
    if ckpt is not None:
      ckpt.close()
    run_dir.close()


def load_params(workdir: Any, model_cfg: ModelConfig, seed: int = 0, mesh=None) -> tuple[Any, dict, int]:
  """(graphdef, params, step) from the latest SFT checkpoint in `workdir` (params item only)."""
  graphdef, params = train_state.init_params(model_cfg, seed, mesh)
  ckpt = Checkpointer(workdir, create=False)  # a reader: a mistyped path is not created
  try:
    items, _, step = ckpt.restore({"params": params})
  finally:
    ckpt.close()
  return graphdef, items["params"], step
