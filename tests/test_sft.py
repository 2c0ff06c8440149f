"""SFT job: runs end to end, checkpoints, and resumes after a crash to the same final parameters."""
import os

import jax
import numpy as np
import pytest

from rl_jax import sft
from rl_jax.config_utils import ConfigError
from rl_jax.config_utils import from_dict
from rl_jax.configs import sft_countdown_tiny
from rl_jax.models import ModelConfig
from rl_jax.metrics import read_metrics


def _config():
  cfg = sft_countdown_tiny.get_config("test")
  cfg.sft.eval_every = 12  # one eval at the end keeps the test short
  return cfg


def _final_params(workdir):
  cfg = _config()
  _, params, step = sft.load_params(workdir, from_dict(ModelConfig, cfg.model))
  return params, step


class InjectedCrash(RuntimeError):
  pass


@pytest.mark.slow  # ~75 s
def test_sft_crash_resume_matches_uninterrupted(tmp_path, monkeypatch):
  clean = str(tmp_path / "clean")
  sft.run(_config(), clean)
  want, step = _final_params(clean)
  assert step == 12
  rows = read_metrics(clean)
  assert [r["step"] for r in rows] == list(range(1, 13))
  assert "eval_accuracy" in rows[-1]

  crashed = str(tmp_path / "crashed")
  # Dies after step 6 (last checkpoint is 4): the data loader fails while making batch 7.
  real_batch, calls = sft.data_lib.sft_batch, []

  def batch_or_die(*args, **kwargs):
    calls.append(1)
    if len(calls) == 7:
      raise InjectedCrash("injected crash after step 6")
    return real_batch(*args, **kwargs)
  with monkeypatch.context() as m:
    m.setattr(sft.data_lib, "sft_batch", batch_or_die)
    with pytest.raises(InjectedCrash):
      sft.run(_config(), crashed)
  assert [r["step"] for r in read_metrics(crashed)] == list(range(1, 7))
  sft.run(_config(), crashed)
  # The killed attempt's rows after the restored checkpoint (5, 6) were dropped: each step once.
  assert [r["step"] for r in read_metrics(crashed)] == list(range(1, 13))
  got, step = _final_params(crashed)
  assert step == 12
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), got, want)


def test_sft_config_errors_name_the_key(tmp_path):
  cfg = _config()
  cfg.unlock()
  cfg.sft.bogus = 1
  with pytest.raises(ConfigError, match="sft.bogus"):
    sft.run(cfg, str(tmp_path))
  cfg = _config()
  cfg.optim.name = "lion"
  with pytest.raises(ConfigError, match="optim.name"):
    sft.run(cfg, str(tmp_path))
  cfg = _config()
  cfg.model.vocab_size = 10
  with pytest.raises(ConfigError, match="model.vocab_size"):
    sft.run(cfg, str(tmp_path))
  assert not os.path.exists(tmp_path / "checkpoints")


@pytest.mark.slow
def test_readme_sft_config_reaches_accuracy(tmp_path):
  """The SFT cold start reaches held-out greedy accuracy >= 0.2 within 10 minutes (2 CPU cores)."""
  import time
  cfg = sft_countdown_tiny.get_config()
  cfg.logging.wandb_mode = "disabled"
  cfg.mesh.num_devices = 1  # one device: the figure is for the README command, not the 8-device test mesh
  t0 = time.time()
  final = sft.run(cfg, str(tmp_path))
  elapsed = time.time() - t0
  print(f"SFT: eval_accuracy {final['eval_accuracy']:.3f} in {elapsed:.0f} s")
  assert final["eval_accuracy"] >= 0.2
  assert elapsed <= 600
