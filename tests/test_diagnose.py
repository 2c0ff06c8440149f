"""rl_jax.analysis.diagnose: the KL-spike, entropy-collapse and clip-fraction finders on hand-made runs."""
import json
import math

import pytest

from rl_jax.analysis import diagnose
from rl_jax.analysis.runs import load_run


def test_first_spike():
  steps = [1, 2, 3, 4, 5, 6]
  assert diagnose.first_spike(steps, [1e-3, 1.2e-3, 0.9e-3, 1.1e-3, 5e-3, 1e-3]) == 5
  # 2.9x the median is not a spike; nor is anything under the floor.
  assert diagnose.first_spike(steps, [1e-3, 1e-3, 1e-3, 2.9e-3, 1e-3, 1e-3]) is None
  assert diagnose.first_spike(steps, [1e-9, 1e-9, 5e-5, 1e-9, 1e-9, 1e-9]) is None
  # The median of the last `window` steps: an old spike does not hide a new one.
  assert diagnose.first_spike(steps, [1e-3, 1e-2, 1e-3, 1e-3, 1e-3, 1e-2], window=3) == 2
  assert diagnose.first_spike(steps, [1e-3, 1e-3, math.nan, 1e-3, 1e-3, 1e-3]) == 3
  assert diagnose.first_spike([], []) is None
  with pytest.raises(ValueError):
    diagnose.first_spike(steps, [1.0] * 6, factor=1.0)


def test_first_below():
  assert diagnose.first_below([0, 10, 20, 30], [4.0, 3.0, 2.1, 1.9]) == 30
  assert diagnose.first_below([0, 10, 20], [4.0, 3.0, 2.0]) is None   # 2.0 is not below 0.5 * 4.0
  assert diagnose.first_below([0, 10], [4.0, math.inf]) == 10
  with pytest.raises(ValueError):
    diagnose.first_below([0], [1.0], fraction=1.0)


def _workdir(tmp_path, rows):
  with open(tmp_path / "metrics.jsonl", "w") as f:
    for r in rows:
      f.write(json.dumps(r) + "\n")
  return load_run(str(tmp_path), name="run")


def test_diagnose_a_run(tmp_path):
  rows = []
  for s in range(1, 9):
    rows.append({"step": s, "reward": 0.5, "mismatch/kl_k3": 1e-3 if s != 6 else 1e-2,
                 "loss/entropy": 3.0 if s < 7 else 1.0, "loss/frac_clipped": 0.1 * s, "loss/is_ratio_mean": 1.0})
  rows[0]["eval_greedy_accuracy"] = 0.4
  rows[7]["eval_greedy_accuracy"] = 0.1
  d = diagnose.diagnose(_workdir(tmp_path, rows))
  assert (d.kl_spike_step, d.entropy_collapse_step, d.aborted_step, d.last_step) == (6, 7, None, 8)
  assert d.accuracy_collapse_step is None   # 0.1 is above the collapse floor (0.005), and step 8 is not after 20
  mean, mx, at = d.clip["loss/frac_clipped"]
  assert at == 8 and mx == pytest.approx(0.8) and mean == pytest.approx(0.45)
  assert list(d.clip) == ["loss/frac_clipped"]
  assert d.first_problem == ("KL spike", 6)
  table = diagnose.markdown([d])
  assert "| run | 8 | 6 | 7 | - | - | loss/frac_clipped 0.8 @ 8 |" in table


def test_healthy_run_has_no_problem(tmp_path):
  rows = [{"step": s, "reward": 0.5, "mismatch/kl_k3": 1e-3, "loss/entropy": 3.0} for s in range(1, 5)]
  d = diagnose.diagnose(_workdir(tmp_path, rows))
  assert d.first_problem is None and d.clip == {}
