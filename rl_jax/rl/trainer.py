"""RL job: synchronous single-controller loop of sampling, scoring, p_old forward, N updates and sync."""
from __future__ import annotations

import collections
import dataclasses
import functools
import json
import os
import time
from typing import Any, Literal

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import tqdm
from flax import nnx

from rl_jax import data as data_lib
from rl_jax import experiment as ex
from rl_jax import sharding as sh
from rl_jax.checkpoint import Checkpointer
from rl_jax.config_utils import ConfigError, from_dict, require
from rl_jax.metrics import LoggingConfig, MetricsWriter, read_metrics
from rl_jax.models import ModelConfig
from rl_jax.optim import OptimConfig, make_optimizer
from rl_jax.rl import plots
from rl_jax.rl.advantages import compute_advantages
from rl_jax.rl.loss_config import AdvantageConfig, LossConfig
from rl_jax.rl.losses import chunked_logprobs, gather_logprobs, rl_loss, rl_loss_from_hidden
from rl_jax.sampler import generate as gen
from rl_jax.sampler import weights as sampler_weights
from rl_jax.sampler.config import SamplerConfig, sampler_config

Replay = Literal["none", "R2", "R3"]

# Test hooks (module attributes so tests can monkeypatch them): poison the loss with NaN
# at this global step; raise InjectedCrash after this step completed.
_INJECT_NAN_AT_STEP: int | None = None
_CRASH_AFTER_STEP: int | None = None


class InjectedCrash(RuntimeError):
  pass


@dataclasses.dataclass(frozen=True)
class RLConfig:
  """The loop: B prompts x G completions per global step, split into N mini-batch updates.

  `staleness` is K of 001: the sampler's weights are refreshed only every K steps.
  `routing_replay`: 'none', 'R2' (replay the trainer's own theta_old experts) or 'R3'
  (replay the sampler's experts), applied to every update of the global step (000).
  Held-out eval every `eval_every` steps on `eval_size` fixed prompts: greedy accuracy, and
  `eval_samples` completions per prompt at `eval_temperature` for the sampled accuracy
  (mean@k: the policy's expected held-out reward) and pass@k.
  """
  steps: int = 100
  prompts_per_step: int = 16
  group_size: int = 8
  n_minibatches: int = 1
  staleness: int = 1
  routing_replay: Replay = "none"
  eval_every: int = 25
  eval_size: int = 128
  eval_temperature: float = 1.0
  eval_samples: int = 4
  checkpoint_every: int = 25
  max_to_keep: int = 2
  plot: bool = True

  def __post_init__(self):
    for k in ("steps", "prompts_per_step", "group_size", "n_minibatches", "staleness",
              "eval_every", "eval_size", "eval_samples", "checkpoint_every", "max_to_keep"):
      require(getattr(self, k) >= 1, f"rl.{k}", f"must be >= 1, got {getattr(self, k)}")
    require(self.prompts_per_step % self.n_minibatches == 0, "rl.n_minibatches",
            f"prompts_per_step={self.prompts_per_step} must split into {self.n_minibatches} "
            "group-aligned mini-batches")


@dataclasses.dataclass(frozen=True)
class WarmStartConfig:
  """Where the RL policy starts.

  'auto': the SFT checkpoint in `path` (default `<workdir>/warm_start`), produced there
  by running the config's `sft` / `sft_optim` sections first if it does not exist yet;
  'sft': an existing SFT workdir; 'hf': a Hugging Face checkpoint directory (the model
  shape then comes from its config.json); 'none': random initialization.
  """
  source: Literal["auto", "sft", "hf", "none"] = "auto"
  path: str = ""


TOP_LEVEL = {"job", "seed", "task", "model", "mesh", "optim", "sampler", "loss", "advantage", "rl",
             "warm_start", "sft", "sft_optim", "logging"}


@dataclasses.dataclass(frozen=True)
class RLJob:
  """All sections of an RL config as validated dataclasses (jitted code never sees a ConfigDict)."""
  seed: int
  task: ex.TaskConfig
  model: ModelConfig
  mesh: sh.MeshConfig
  optim: OptimConfig
  sampler: SamplerConfig
  loss: LossConfig
  advantage: AdvantageConfig
  rl: RLConfig
  warm_start: WarmStartConfig
  logging: LoggingConfig

  @classmethod
  def from_config(cls, config: Any) -> "RLJob":
    ex.check_top_level(config, TOP_LEVEL)
    rl = ex.section(config, "rl", RLConfig)
    optim = config.get("optim", {})
    optim = dict(optim.to_dict() if hasattr(optim, "to_dict") else optim)
    if optim.get("schedule") == "cosine" and not optim.get("total_steps"):
      # 0 = the whole run, so overriding rl.steps stretches the schedule with it.
      optim["total_steps"] = rl.steps * rl.n_minibatches
    job = cls(seed=int(config.get("seed", 0)),
              task=ex.section(config, "task", ex.TaskConfig),
              model=ex.section(config, "model", ModelConfig),
              mesh=ex.section(config, "mesh", sh.MeshConfig),
              optim=from_dict(OptimConfig, optim, prefix="optim"),
              sampler=sampler_config(config.get("sampler", {})),
              loss=ex.section(config, "loss", LossConfig),
              advantage=ex.section(config, "advantage", AdvantageConfig),
              rl=rl,
              warm_start=ex.section(config, "warm_start", WarmStartConfig),
              logging=ex.section(config, "logging", LoggingConfig))
    job.check()
    return job

  def check(self) -> None:
    """Cross-section combinations that cannot work fail here, before any compute."""
    s, l = self.sampler, self.loss
    require(abs(s.temperature - l.temperature) < 1e-12, "loss.temperature",
            f"{l.temperature} differs from sampler.temperature={s.temperature}: the trainer must "
            "score tokens at the sampler's temperature (SPEC 'Log-prob semantics')")
    require(not s.greedy, "sampler.greedy", "RL needs sampled rollouts (greedy has no valid logq)")
    if l.score_centering == "topk":
      require(s.record_topk >= l.topk, "sampler.record_topk",
              f"{s.record_topk} < loss.topk={l.topk}: top-k score centering needs the sampler's top-k")
    if l.score_centering == "full":
      require(s.record_topk == self.model.vocab_size, "sampler.record_topk",
              f"full score centering needs the sampler's full distribution: set it to "
              f"model.vocab_size={self.model.vocab_size}")
    s.check_vocab(self.model.vocab_size)
    check_sampler_fits(self.model, s)
    require(self.rl.routing_replay == "none" or self.model.is_moe, "rl.routing_replay",
            f"{self.rl.routing_replay!r} needs an MoE model (model.n_experts > 0)")
    require(self.rl.routing_replay != "R3" or s.record_experts, "sampler.record_experts",
            "R3 replays the sampler's experts: record_experts must be True")


def check_sampler_fits(model_cfg: ModelConfig, s: SamplerConfig) -> None:
  """Quantization block sizes must divide the model's shapes: checked abstractly (no memory)."""
  from rl_jax.quant import kv as qkv  # pylint: disable=g-import-not-at-top
  from rl_jax.quant.params import quantize_params  # pylint: disable=g-import-not-at-top
  _, state = ex.abstract_state(model_cfg)
  jax.eval_shape(lambda p: quantize_params(p, s.quant), nnx.to_pure_dict(state))
  if s.quant.kv.format not in ("fp32", "bf16"):
    block = s.quant.kv.block_size if s.quant.kv.granularity == "block" else None
    require(block is None or model_cfg.head_dim % block == 0, "sampler.quant.kv.block_size",
            f"{block} does not divide model.head_dim={model_cfg.head_dim}")
    slab = jax.ShapeDtypeStruct((1, 1, model_cfg.n_kv_heads, model_cfg.head_dim), jnp.float32)
    jax.eval_shape(lambda x: qkv.kv_quantize(x, s.quant.kv), slab)


def _masked_mean(x, mask):
  mask = mask.astype(jnp.float32)
  return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def routing_agreement(trainer_ids_BSLK, sampler_ids_BSLK, valid_BS):
  """Fraction of (token, MoE layer, slot) where the sampler's expert is among the trainer's top-k."""
  hit = jnp.any(sampler_ids_BSLK[..., :, None] == trainer_ids_BSLK[..., None, :], axis=-1)
  mask = jnp.broadcast_to(valid_BS[:, :, None, None], hit.shape)
  return _masked_mean(hit.astype(jnp.float32), mask)


class RLTrainer:
  """Holds the trainer and sampler state of one RL run; `run()` is the job."""

  def __init__(self, config: Any, workdir: str):
    self.config = config
    self.workdir = workdir
    self.job = job = RLJob.from_config(config)
    self.mesh = sh.make_mesh(job.mesh)
    b, g, n = job.rl.prompts_per_step, job.rl.group_size, job.rl.n_minibatches
    div = sh.batch_divisor(self.mesh)
    if (b // n) * g % div:
      raise ConfigError(f"config key 'rl.prompts_per_step': mini-batches of {(b // n) * g} "
                        f"responses do not split over the mesh's batch axes ({div})")
    ex.check_batch(job.rl.eval_size, "rl.eval_size", self.mesh)
    self.task = ex.make_task(job.task)
    if job.warm_start.source == "hf":
      from rl_jax.tasks.hf_tokenizer import HFTokenizer  # pylint: disable=g-import-not-at-top
      self.tok = HFTokenizer.from_dir(job.warm_start.path)
    else:
      self.tok = ex.make_tokenizer(self.task, job.model)
    self._check_tokens()
    os.makedirs(workdir, exist_ok=True)

    self.ckpt = Checkpointer(workdir, max_to_keep=job.rl.max_to_keep)
    resuming = self.ckpt.latest_step() is not None
    # On resume the checkpoint overwrites everything: skip the (possibly costly) warm start
    # and only build the structure and shardings to restore into.
    self.graphdef, params = (ex.init_params(job.model, job.seed, self.mesh) if resuming
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
    if resuming:
      self.state, _, self.start_step = self.ckpt.restore(self.state)
      print(f"[rl] resumed from step {self.start_step} in {self.ckpt.directory}")
    self.sampler_graphdef = sampler_weights.sampler_graphdef(job.model, job.sampler.dtype)
    # Evaluation uses the clean float32 weights whatever the sampler's dtype.
    self.eval_graphdef = sampler_weights.sampler_graphdef(job.model, "float32")
    self.eval_cfg = dataclasses.replace(job.sampler, greedy=True, noise="none", noise_sigma=0.0,
                                        quant="none", dtype="float32", record_topk=0,
                                        record_experts=False)
    self.eval_sampled_cfg = dataclasses.replace(self.eval_cfg, greedy=False,
                                                temperature=job.rl.eval_temperature)
    self._build_steps()
    self.sync_sampler()

  # -- set-up ---------------------------------------------------------------------------------

  def _check_tokens(self) -> None:
    s = self.job.sampler
    for key, want in (("eos_id", self.tok.eos_id), ("pad_id", self.tok.pad_id)):
      require(getattr(s, key) == want, f"sampler.{key}",
              f"{getattr(s, key)} differs from the tokenizer's {key} {want}")

  def _warm_start(self):
    ws, job = self.job.warm_start, self.job
    if ws.source == "none":
      return ex.init_params(job.model, job.seed, self.mesh)
    if ws.source == "hf":
      from rl_jax.models import hf  # pylint: disable=g-import-not-at-top
      m = job.model
      model = hf.load_hf_model(ws.path, mesh=self.mesh, dtype=m.dtype, param_dtype=m.param_dtype,
                               remat=m.remat, router_aux_loss_coef=m.router_aux_loss_coef)
      if model.cfg != job.model:
        raise ConfigError(f"config key 'model': differs from the HF checkpoint {ws.path}/config.json; "
                          f"set model to {model.cfg}")
      graphdef, state = nnx.split(model)
      return graphdef, nnx.to_pure_dict(state)
    from rl_jax import sft  # pylint: disable=g-import-not-at-top
    path = ws.path or os.path.join(self.workdir, "warm_start")
    warm = Checkpointer(path)
    done = warm.latest_step()
    warm.close()
    if ws.source == "auto":
      sft_config = self._sft_config()
      if done is None or done < sft_config.sft.steps:
        print(f"[rl] no warm start in {path}: running SFT first (cached for later runs)")
        sft.run(sft_config, path)
    elif done is None:
      raise FileNotFoundError(f"config key 'warm_start.path': no SFT checkpoint in {path}")
    graphdef, params, step = sft.load_params(path, job.model, job.seed, self.mesh)
    print(f"[rl] warm start: SFT step {step} from {path}")
    return graphdef, params

  def _sft_config(self) -> ml_collections.ConfigDict:
    c = self.config
    if "sft" not in c:
      raise ConfigError("config key 'sft': warm_start.source='auto' needs an 'sft' section "
                        "(and 'sft_optim') to produce the warm start")
    cfg = ml_collections.ConfigDict(dict(job="sft", seed=c.get("seed", 0), task=c.task.to_dict(),
                                         model=c.model.to_dict(), mesh=c.get("mesh", {}),
                                         optim=c.get("sft_optim", {}), sft=c.sft.to_dict(),
                                         logging=dict(wandb_mode="disabled")))
    return cfg

  def _build_steps(self) -> None:
    job = self.job
    graphdef, mesh = self.graphdef, self.mesh
    temp = job.loss.temperature
    aux_coef = job.model.router_aux_loss_coef
    loss_cfg = job.loss
    param_sh = jax.tree.map(lambda x: x.sharding, self.state["params"])
    opt_sh = jax.tree.map(lambda x: x.sharding, self.state["opt_state"])

    def old_forward(params, ro: dict, prompt_len: int):
      """p_old of the sampled tokens and the trainer's own theta_old routing (one forward)."""
      model = nnx.merge(graphdef, params)
      chunked = loss_cfg.chunk_size > 0
      out = model(ro["tokens_BS"], ro["positions_BS"], ro["valid_BS"], return_hidden=chunked,
                  compute_logits=not chunked)
      t = ro["logq_BT"].shape[1]
      if chunked:  # never materialize [B, S, V] logits for long responses
        hidden = gen.response_slots(out.hidden_BTD, prompt_len, t)
        logp_old_BT = chunked_logprobs(hidden, model.unembed_weight(), ro["response_BT"][..., None],
                                       temp, loss_cfg.chunk_size)[0][..., 0]
      else:
        # The function the loss computes log p with (chunked or not): p_old and p agree in form.
        logits_BTV = gen.response_slots(out.logits_BTV, prompt_len, t)
        logp_old_BT = gather_logprobs(logits_BTV, ro["response_BT"][..., None], temp)[0][..., 0]
      mask = ro["response_mask_BT"]
      log_x = logp_old_BT - ro["logq_BT"]
      x = jnp.exp(log_x)
      p_old, q = jnp.exp(logp_old_BT), jnp.exp(ro["logq_BT"])
      m = {"kl_k1": _masked_mean(-log_x, mask), "kl_k3": _masked_mean(x - 1.0 - log_x, mask),
           "prob_diff_mean": _masked_mean(jnp.abs(p_old - q), mask),
           "prob_diff_max": jnp.max(jnp.where(mask, jnp.abs(p_old - q), 0.0))}
      if "expert_ids_BSLK" in ro:
        m["routing_agreement"] = routing_agreement(out.expert_ids_BTLK, ro["expert_ids_BSLK"],
                                                   ro["expert_valid_BS"])
      return logp_old_BT, out.expert_ids_BTLK, m

    def loss_fn(params, mb: dict, prompt_len: int):
      """Loss of one mini-batch; routing replay is on iff `mb` carries replay ids."""
      model = nnx.merge(graphdef, params)
      kw = {}
      if "replay_ids_BSLK" in mb:
        kw = dict(replay_ids_BTLK=mb["replay_ids_BSLK"], replay_mask_BT=mb["replay_mask_BS"])
      chunked = loss_cfg.chunk_size > 0
      out = model(mb["tokens_BS"], mb["positions_BS"], mb["valid_BS"], return_hidden=chunked,
                  compute_logits=not chunked, **kw)
      t = mb["logq_BT"].shape[1]
      args = (mb["response_BT"], mb["response_mask_BT"], mb["adv_B"], mb["logq_BT"], loss_cfg)
      opt = dict(logp_old_BT=mb["logp_old_BT"], topk_ids_BTK=mb.get("topk_ids_BTK"),
                 topk_logq_BTK=mb.get("topk_logq_BTK"))
      if chunked:
        hidden = gen.response_slots(out.hidden_BTD, prompt_len, t)
        loss, metrics = rl_loss_from_hidden(hidden, model.unembed_weight(), *args, **opt)
      else:
        loss, metrics = rl_loss(gen.response_slots(out.logits_BTV, prompt_len, t), *args, **opt)
      # The load-balancing loss uses the trainer's own routing, also under replay (models/moe.py).
      return loss + aux_coef * out.aux_loss, dict(metrics, aux_loss=out.aux_loss)

    def update(params, opt_state, mb: dict, poison, prompt_len: int):
      (loss, metrics), grads = jax.value_and_grad(
          lambda p: (lambda l, m: (l + poison, m))(*loss_fn(p, mb, prompt_len)), has_aux=True)(params)
      gnorm = optax.global_norm(grads)
      ok = jnp.isfinite(loss) & jnp.isfinite(gnorm)
      updates, new_opt = self.optimizer.update(grads, opt_state, params)
      new_params = optax.apply_updates(params, updates)
      # A non-finite step is never applied: the host raises and nothing is saved.
      keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)
      return keep(new_params, params), keep(new_opt, opt_state), dict(
          metrics, loss=loss, grad_norm=gnorm, finite=ok)

    self.loss_and_grad = jax.jit(jax.value_and_grad(loss_fn, has_aux=True), static_argnums=(2,))
    self._old_forward = jax.jit(old_forward, static_argnums=(2,))
    self._update = jax.jit(update, donate_argnums=(0, 1), static_argnums=(4,),
                           out_shardings=(param_sh, opt_sh, sh.replicated(mesh)))
    self._advantages = jax.jit(functools.partial(compute_advantages, group_size=job.rl.group_size,
                                                 cfg=job.advantage))

  # -- the pieces of one global step ---------------------------------------------------------

  def sync_sampler(self) -> None:
    """Sampler weights = cast(quantize(theta + Delta)) from the last synced trainer params."""
    src = self.state.get("sampler_src", self.state["params"])
    self.sampler_state = sampler_weights.sync_weights(src, self.state.get("noise"),
                                                      self.job.sampler.quant, self.job.sampler.dtype)

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
    ids, valid = gen.repeat_prompts((ids, valid), g)
    key = jax.random.fold_in(jax.random.key(self.job.seed), step)
    ro = gen.generate(self.sampler_graphdef, self.sampler_state, ids, valid, key, self.job.sampler,
                      mesh=self.mesh)
    return [p for p in problems for _ in range(g)], ro

  def completions(self, ro) -> list[str]:
    """Response texts on the host: the only place tokens leave the device."""
    return data_lib.decode_completions(self.tok, sh.to_host(ro.response_BT))

  def score(self, problems, ro) -> np.ndarray:
    """Task rewards, computed on the host."""
    return np.asarray([self.task.reward(p, t) for p, t in zip(problems, self.completions(ro))],
                      np.float32)

  def batch_arrays(self, ro) -> dict:
    d = dict(tokens_BS=ro.tokens_BS, positions_BS=ro.positions_BS, valid_BS=ro.valid_BS,
             response_BT=ro.response_BT, response_mask_BT=ro.response_mask_BT, logq_BT=ro.logq_BT,
             prompt_len=ro.prompt_len)
    if ro.topk_ids_BTK is not None and self.job.loss.needs_topk:
      d["topk_ids_BTK"], d["topk_logq_BTK"] = ro.topk_ids_BTK, ro.topk_logq_BTK
    if ro.expert_ids_BSLK is not None and self.job.model.is_moe:
      d["expert_ids_BSLK"], d["expert_valid_BS"] = ro.expert_ids_BSLK, ro.expert_valid_BS
    return d

  def prepare(self, ro, rewards: np.ndarray):
    """Advantages, the theta_old forward and the replay routes of this global step."""
    batch = self.batch_arrays(ro)
    prompt_len = batch.pop("prompt_len")
    batch["adv_B"] = self._advantages(jnp.asarray(rewards))
    logp_old, old_ids, m = self._old_forward(self.state["params"], batch, prompt_len)
    batch["logp_old_BT"] = logp_old
    replay = self.job.rl.routing_replay
    if replay == "R2":
      batch["replay_ids_BSLK"], batch["replay_mask_BS"] = old_ids, batch["valid_BS"]
    elif replay == "R3":
      batch["replay_ids_BSLK"], batch["replay_mask_BS"] = batch["expert_ids_BSLK"], batch["expert_valid_BS"]
    batch.pop("expert_ids_BSLK", None)
    batch.pop("expert_valid_BS", None)
    return batch, prompt_len, m

  def minibatches(self, batch: dict):
    n = self.job.rl.n_minibatches
    rows = next(iter(batch.values())).shape[0] // n
    for i in range(n):
      yield jax.tree.map(lambda x, i=i: x[i * rows:(i + 1) * rows], batch)

  def update(self, batch: dict, prompt_len: int, step: int) -> dict:
    """N optimizer updates on group-aligned mini-batches; raises on a non-finite step."""
    metrics = []
    for i, mb in enumerate(self.minibatches(batch)):
      poison = jnp.float32(jnp.nan if _INJECT_NAN_AT_STEP == step + 1 else 0.0)
      params, opt_state, m = self._update(self.state["params"], self.state["opt_state"], mb, poison,
                                          prompt_len)
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
    """One global step; returns its metrics (SPEC "Diagnostics")."""
    t0 = time.perf_counter()
    problems, ro = self.rollout(step)
    rewards = self.score(problems, ro)
    t1 = time.perf_counter()
    batch, prompt_len, m_old = self.prepare(ro, rewards)
    m_old = sh.to_host(m_old)
    t2 = time.perf_counter()
    m_upd = self.update(batch, prompt_len, step)
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
    head = sh.to_host(ro.head_mass_BT) if ro.head_mass_BT is not None else None
    mask = sh.to_host(ro.response_mask_BT)
    row = {"reward": float(rewards.mean()), "accuracy": float((rewards >= 1.0).mean()),
           "response_length": float(lengths.mean()),
           **{k: float(v) for k, v in m_old.items()},
           **{f"loss/{k}": v for k, v in m_upd.items()},
           "time/sample_s": t1 - t0, "time/p_old_s": t2 - t1, "time/update_s": t3 - t2,
           "time/sync_s": t4 - t3}
    if head is not None and mask.any():
      row["sampler_head_mass_mean"] = float(np.asarray(head)[mask].mean())
      row["sampler_head_mass_min"] = float(np.asarray(head)[mask].min())
    return row

  def evaluate(self) -> dict:
    """Held-out greedy accuracy, sampled mean@k and pass@k; clean fp32 weights (no quant, noise)."""
    n, k = self.job.rl.eval_size, self.job.rl.eval_samples
    problems, ids, valid = self.prompts(0, split="eval", count=n, start=0)
    clean = sampler_weights.sync_weights(self.state["params"], None, None, "float32")
    key = jax.random.fold_in(jax.random.key(self.job.seed), 0xE7A1)
    ro = gen.generate(self.eval_graphdef, clean, ids, valid, key, self.eval_cfg, mesh=self.mesh)
    texts = self.completions(ro)
    greedy = [self.task.reward(p, t) for p, t in zip(problems, texts)]
    out = {"eval_greedy_accuracy": float(np.mean(greedy))}
    if hasattr(self.task, "reward_details"):
      # Why greedy answers fail (malformed, wrong numbers, wrong value): what RL is fixing.
      outcomes = collections.Counter(self.task.reward_details(p, t).error or "correct"
                                     for p, t in zip(problems, texts))
      out.update({f"eval_greedy_outcome/{name}": c / n for name, c in sorted(outcomes.items())})
    ids, valid = gen.repeat_prompts((ids, valid), k)
    ro = gen.generate(self.eval_graphdef, clean, ids, valid, key, self.eval_sampled_cfg, mesh=self.mesh)
    r_nk = self.score([p for p in problems for _ in range(k)], ro).reshape(n, k)
    out["eval_sampled_accuracy"] = float(r_nk.mean())
    out["eval_pass_at_k"] = float((r_nk >= 1.0).any(axis=1).mean())
    return out

  def save(self, step: int) -> None:
    self.ckpt.save(step, self.state, {"step": step, "seed": self.job.seed, "job": "rl"})

  # -- the job ---------------------------------------------------------------------------------

  def run(self) -> dict:
    job = self.job
    writer = MetricsWriter(self.workdir, job.logging,
                           self.config.to_dict() if hasattr(self.config, "to_dict") else None)
    history = []
    if self.start_step == 0:
      first = {"step": 0, **self.evaluate()}
      writer.write(0, first)
      history.append(first)
    bar = tqdm.tqdm(range(self.start_step, job.rl.steps), initial=self.start_step, total=job.rl.steps,
                    desc="rl", disable=jax.process_index() != 0, mininterval=2.0)
    row: dict = {}
    try:
      for step in bar:
        row = self.train_step(step)
        done = step + 1
        if done % job.rl.eval_every == 0 or done == job.rl.steps:
          row.update(self.evaluate())
        writer.write(done, row)
        history.append({"step": done, **row})
        bar.set_postfix(reward=f"{row['reward']:.3f}", kl=f"{row['kl_k1']:.2e}")
        if done % job.rl.checkpoint_every == 0 or done == job.rl.steps:
          self.save(done)
        if _CRASH_AFTER_STEP is not None and done == _CRASH_AFTER_STEP:
          raise InjectedCrash(f"injected crash after step {done}")
    finally:
      bar.close()
      writer.close()
      self.ckpt.close()
    summary = self.summarize()
    return summary

  def summarize(self) -> dict:
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
      summary.update(final_reward=train[-1]["reward"], mean_kl_k1=float(np.mean([r["kl_k1"] for r in train])),
                     steps=train[-1]["step"])
    if jax.process_index() == 0:
      with open(os.path.join(self.workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
      if self.job.rl.plot and rows:
        plots.plot_run(rows, os.path.join(self.workdir, "rl_curves.png"))
      print("[rl] " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                for k, v in summary.items()))
    return summary


def run(config: Any, workdir: str) -> dict:
  return RLTrainer(config, workdir).run()
