"""Optimizer from config: SGD (the papers' default) or AdamW, with optional clipping and warmup."""
from __future__ import annotations

import dataclasses
from typing import Literal

import optax

from rl_jax.config_utils import require


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  name: Literal["sgd", "adamw"] = "sgd"
  lr: float = 1e-2
  schedule: Literal["constant", "cosine"] = "constant"
  warmup_steps: int = 0
  total_steps: int = 0          # needed by 'cosine' (counts optimizer updates; RL: 0 = the whole run)
  weight_decay: float = 0.0
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  momentum: float = 0.0
  grad_clip: float = 0.0        # global-norm clip; 0 = off

  def __post_init__(self):
    require(self.lr > 0, "optim.lr", f"must be > 0, got {self.lr}")
    require(self.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0")
    require(self.grad_clip >= 0, "optim.grad_clip", "must be >= 0")
    require(self.schedule != "cosine" or self.total_steps > self.warmup_steps, "optim.total_steps",
            "cosine schedule needs total_steps > warmup_steps")


def make_schedule(cfg: OptimConfig) -> optax.Schedule:
  if cfg.schedule == "cosine":
    return optax.warmup_cosine_decay_schedule(0.0, cfg.lr, max(cfg.warmup_steps, 1), cfg.total_steps,
                                              end_value=0.1 * cfg.lr)
  if cfg.warmup_steps:
    return optax.linear_schedule(0.0, cfg.lr, cfg.warmup_steps)
  return optax.constant_schedule(cfg.lr)


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
  lr = make_schedule(cfg)
  if cfg.name == "sgd":
    opt = optax.sgd(lr, momentum=cfg.momentum or None)
  else:
    opt = optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay)
  if cfg.grad_clip:
    opt = optax.chain(optax.clip_by_global_norm(cfg.grad_clip), opt)
  return opt
