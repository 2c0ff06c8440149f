"""Where the RL policy starts: random init, an SFT workdir (made first if missing) or an HF checkpoint."""
from __future__ import annotations

from typing import Any

import ml_collections
from flax import nnx

from rl_jax import sft
from rl_jax import train_state
from rl_jax.checkpoint import Checkpointer
from rl_jax.config_utils import ConfigError
from rl_jax.models.config import EXECUTION_FIELDS
from rl_jax.rl.job import RLJob


def sft_config(config: Any) -> ml_collections.ConfigDict:
  """The SFT job that produces an 'auto' warm start: the RL config's task/model/mesh + its sft sections."""
  if "sft" not in config:
    raise ConfigError("config key 'sft': warm_start.source='auto' needs an 'sft' section "
                      "(and 'sft_optim') to produce the warm start")
  c = config
  out = dict(job="sft", seed=c.get("seed", 0), task=c.task.to_dict(), model=c.model.to_dict(),
             mesh=c.get("mesh", {}), optim=c.get("sft_optim", {}), sft=c.sft.to_dict(),
             logging=dict(wandb_mode="disabled"))
  if "resume" in c:
    out["resume"] = c.resume
  return ml_collections.ConfigDict(out)


def check_sft_section(config: Any, task: Any, tok: Any) -> None:
  """The SFT job an 'auto' warm start runs, validated before any compute (even when its checkpoint
  exists already and it will not run: a bad key is an error in the config either way)."""
  job = sft.SFTJob.from_config(sft_config(config))
  job.check_data(task, tok)


def warm_start(job: RLJob, config: Any, workdir: str, mesh) -> tuple[nnx.GraphDef, dict]:
  """(graphdef, params) of the policy at RL step 0, per `job.warm_start` (see WarmStartConfig).

  `workdir` is the RL run's `<workdir>/warm_start` (a string; may be remote), used when
  `warm_start.path` is empty.
  """
  ws = job.warm_start
  if ws.source == "none":
    return train_state.init_params(job.model, job.seed, mesh)
  if ws.source == "hf":
    from rl_jax.models import hf  # pylint: disable=g-import-not-at-top
    m = job.model
    # The job's execution choices (precision, remat, layout, kernels) over the checkpoint's architecture.
    model = hf.load_hf_model(ws.path, mesh=mesh, **{f: getattr(m, f) for f in EXECUTION_FIELDS})
    if model.cfg != job.model:
      raise ConfigError(f"config key 'model': differs from the HF checkpoint {ws.path}/config.json; "
                        f"set model to {model.cfg}")
    graphdef, state = nnx.split(model)
    return graphdef, nnx.to_pure_dict(state)
  path = ws.path or workdir
  # A reader: a mistyped path is reported, not created.
  warm = Checkpointer(path, create=False)
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
