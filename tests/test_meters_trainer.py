"""The trainer logs both meters: drift top-level when the sampler records its top-k, first_order every M steps."""
import numpy as np
import pytest

from rl_jax.configs import countdown_tiny
from rl_jax.rl import trainer as trainer_lib
from rl_jax.study import sweeps


# Builds a trainer and compiles sampler, p_old forward, update and the meter: minutes on 2 busy cores.
@pytest.mark.slow
def test_train_step_logs_drift_and_first_order_meters(tmp_path):
  cfg = countdown_tiny.get_config("test")
  cfg.warm_start.source = "none"
  cfg.mesh.tensor = 2
  cfg = sweeps.apply_overrides(cfg, {"rl.meter_every": 2})
  tr = trainer_lib.RLTrainer(cfg, str(tmp_path))
  first = tr.train_step(0)   # step 1 of a meter_every=2 run: no first-order meter
  assert not any(k.startswith("first_order/") for k in first)
  row = tr.train_step(1)     # step 2: the meter ran
  for k in ("drift/tv_mean", "drift/tv_max", "first_order/cosine", "first_order/norm_ratio"):
    assert k in row and np.isfinite(row[k]), (k, row.get(k))
  assert not any(k.startswith("loss/drift") for k in row)
  # fp32 sampler without noise: q and p agree up to rounding, so the drift is ~0.
  assert 0.0 <= row["drift/tv_mean"] <= row["drift/tv_max"] < 1e-3
  assert -1.0 - 1e-5 <= row["first_order/cosine"] <= 1.0 + 1e-5
