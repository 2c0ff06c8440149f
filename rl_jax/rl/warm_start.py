"""Where the RL policy starts: random init, an SFT workdir (made first if missing) or an HF checkpoint."""
from __future__ import annotations

import os
from typing import Any

import ml_collections
from flax import nnx

from rl_jax import experiment as ex
from rl_jax.checkpoint import Checkpointer
from rl_jax.config_utils import ConfigError
from rl_jax.rl.job import RLJob


def sft_config(config: Any) -> ml_collections.ConfigDict:
  """The SFT job that produces an 'auto' warm start: the RL config's task/model/mesh + its sft sections."""
  if "sft" not in config:
    raise ConfigError("config key 'sft': warm_start.source='auto' needs an 'sft' section "
                      "(and 'sft_optim') to produce the warm start")
  c = config
  return ml_collections.ConfigDict(dict(job="sft", seed=c.get("seed", 0), task=c.task.to_dict(),
                                        model=c.model.to_dict(), mesh=c.get("mesh", {}),
                                        optim=c.get("sft_optim", {}), sft=c.sft.to_dict(),
                                        logging=dict(wandb_mode="disabled")))


def warm_start(job: RLJob, config: Any, workdir: str, mesh) -> tuple[nnx.GraphDef, dict]:
  """(graphdef, params) of the policy at RL step 0, per `job.warm_start` (see WarmStartConfig)."""
  ws = job.warm_start
  if ws.source == "none":
    return ex.init_params(job.model, job.seed, mesh)
  if ws.source == "hf":
    from rl_jax.models import hf  # pylint: disable=g-import-not-at-top
    m = job.model
    model = hf.load_hf_model(ws.path, mesh=mesh, dtype=m.dtype, param_dtype=m.param_dtype,
                             remat=m.remat, router_aux_loss_coef=m.router_aux_loss_coef)
    if model.cfg != job.model:
      raise ConfigError(f"config key 'model': differs from the HF checkpoint {ws.path}/config.json; "
                        f"set model to {model.cfg}")
    graphdef, state = nnx.split(model)
    return graphdef, nnx.to_pure_dict(state)
  from rl_jax import sft  # pylint: disable=g-import-not-at-top
  path = ws.path or os.path.join(workdir, "warm_start")
  warm = Checkpointer(path)
  done = warm.latest_step()
  warm.close()
  if ws.source == "auto":
    cfg = sft_config(config)
    if done is None or done < cfg.sft.steps:
      print(f"[rl] no warm start in {path}: running SFT first (cached for later runs)")
      sft.run(cfg, path)
  elif done is None:
    raise FileNotFoundError(f"config key 'warm_start.path': no SFT checkpoint in {path}")
  graphdef, params, step = sft.load_params(path, job.model, job.seed, mesh)
  print(f"[rl] warm start: SFT step {step} from {path}")
  return graphdef, params
