"""RL job schema: the config sections as validated dataclasses and their cross-section checks."""
from __future__ import annotations

import dataclasses
from typing import Any, Literal

from rl_jax import experiment as ex
from rl_jax import sharding as sh
from rl_jax.config_utils import from_dict, require
from rl_jax.metrics import LoggingConfig
from rl_jax.models import ModelConfig
from rl_jax.optim import OptimConfig
from rl_jax.rl.loss_config import AdvantageConfig, LossConfig
from rl_jax.sampler.checks import check_sampler_fits
from rl_jax.sampler.config import SamplerConfig, sampler_config

Replay = Literal["none", "R2", "R3"]


@dataclasses.dataclass(frozen=True)
class RLConfig:
  """The loop: B prompts x G completions per global step, split into N mini-batch updates.

  `staleness` is K of [SC] (docs/math.md#staleness-and-mini-batches): the sampler's weights are
  refreshed only every K steps.
  `routing_replay`: 'none', 'R2' (replay the trainer's own theta_old experts) or 'R3'
  (replay the sampler's experts), applied to every update of the global step (docs/math.md#routing-replay).
  Held-out eval every `eval_every` steps on `eval_size` fixed prompts: greedy accuracy, and
  `eval_samples` completions per prompt at `eval_temperature` for the sampled accuracy
  (mean@k: the policy's expected held-out reward) and pass@k.
  `meter_every`: the first-order-approximation meter (`first_order/*`) runs on the first
  mini-batch of every `meter_every`-th step (0 = off); see `rl_jax.rl.step.first_order`. One
  call costs about one step (a forward and two backward passes), hence the default of 40
  (benchmarks/bench_rl_step.py --compare meters).
  `forward_microbatch` / `update_microbatch`: rows per micro-batch of the p_old forward and of
  each update's gradient (accumulated over the mini-batch's micro-batches; the first-order
  meter too), 0 = the whole batch at once. Memory, not math: the results equal the one-shot
  ones to float32 rounding (rl_jax/microbatch.py; the load-balancing term is averaged over
  micro-batches). Each must divide its batch and split over the mesh's batch axes.
  `eval_rows_in_flight`: rows the held-out evaluation generates at a time (0 = the sampler's
  `max_rows_in_flight`). Evaluation runs clean float32 weights and a float32 KV cache, up to 4x
  the bytes per row of a quantized sampler's, so long responses need smaller waves there.
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
  meter_every: int = 40
  forward_microbatch: int = 0
  update_microbatch: int = 0
  eval_rows_in_flight: int = 0

  def __post_init__(self):
    for k in ("steps", "prompts_per_step", "group_size", "n_minibatches", "staleness",
              "eval_every", "eval_size", "eval_samples", "checkpoint_every", "max_to_keep"):
      require(getattr(self, k) >= 1, f"rl.{k}", f"must be >= 1, got {getattr(self, k)}")
    require(self.meter_every >= 0, "rl.meter_every", f"must be >= 0 (0 = off), got {self.meter_every}")
    for k in ("forward_microbatch", "update_microbatch", "eval_rows_in_flight"):
      require(getattr(self, k) >= 0, f"rl.{k}", f"must be >= 0 (0 = the whole batch), got {getattr(self, k)}")
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


# `resume` ('check' by default, 'force'): how a workdir with checkpoints treats a changed config
# (rl_jax.workdir.RunDir); optional, so configs without it still load.
TOP_LEVEL = {"job", "seed", "task", "model", "mesh", "optim", "sampler", "loss", "advantage", "rl",
             "warm_start", "sft", "sft_optim", "logging", "resume"}

# Estimators that centre within a group: with one completion per prompt every advantage is 0.
GROUP_RELATIVE = ("group_centered", "grpo")


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
            "score tokens at the sampler's temperature (docs/math.md#log-prob-conventions)")
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
    require(self.rl.group_size >= 2 or self.advantage.mode not in GROUP_RELATIVE, "rl.group_size",
            f"1 with advantage.mode={self.advantage.mode!r}: a group of one has zero advantage "
            "everywhere (nothing to learn); use group_size >= 2 or advantage.mode='raw'")
