"""End-of-run figure: the smoothing is a centered moving average and the PNG is written."""
import math

from etils import epath
import matplotlib.pyplot as plt

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


def test_plot_run_draws_the_meters_and_writes_through_epath(tmp_path, monkeypatch):
  rows = [{"step": i, "reward": 0.5, "drift/tv_mean": 1e-3, "drift/tv_max": 5e-3} for i in range(1, 21)]
  for r in rows[::5]:  # the first-order meter runs every M steps
    r.update({"first_order/cosine": 0.9, "first_order/norm_ratio": 1.1})
  drawn = {}
  real_close = plt.close

  def spy_close(fig):  # the axes' titles and line labels, read before the figure is closed
    drawn.update({ax.get_title(): [l.get_label() for l in ax.lines] for ax in fig.axes})
    real_close(fig)
  monkeypatch.setattr(plots.plt, "close", spy_close)
  path = epath.Path(tmp_path) / "sub" / "rl_curves.png"
  path.parent.mkdir()
  assert plots.plot_run(rows, path) == path
  assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert drawn["Drift: TV(q, p) per token"] == ["drift/tv_mean", "drift/tv_max"]
  assert drawn["First-order approximation: g_tok vs g_seq"] == ["first_order/cosine",
                                                                "first_order/norm_ratio"]
  # Panels of metrics the run never logged are not drawn at all (no empty axes).
  assert "Score centering's share of the update" not in drawn
  assert "Mismatch attribution: KL(q_s || p) per source" not in drawn
  assert sum(1 for ax in drawn if ax) == 3   # reward, drift, first-order: the only ones with data
