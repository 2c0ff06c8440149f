"""End-of-run figure: the smoothing is a centered moving average and the PNG is written."""
import math

from rl_jax.rl import plots


def test_moving_average_is_centered_and_shrinks_at_the_ends():
  assert plots.moving_average([0.0, 3.0, 6.0, 9.0], 3) == [1.5, 3.0, 6.0, 7.5]
  assert plots.moving_average([2.0], 9) == [2.0]


def test_plot_run_writes_a_png_with_sparse_evals_and_nan(tmp_path):
  rows = [{"step": i, "reward": i / 40, "loss/entropy": 1.0 - i / 80, "kl_k1": 1e-3,
           "kl_k3": math.nan} for i in range(1, 41)]
  rows[9].update(eval_greedy_accuracy=0.1, eval_sampled_accuracy=0.05, eval_pass_at_k=0.2)
  path = plots.plot_run(rows, str(tmp_path / "curves.png"))
  with open(path, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
