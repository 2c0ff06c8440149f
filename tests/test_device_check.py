"""benchmarks/device_check.py on CPU: every row ok or skipped with a reason; a failing row never stops the rest; the budget."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "benchmarks", "device_check.py")


def _load():
  spec = importlib.util.spec_from_file_location("device_check", SCRIPT)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses resolve their module by name
  spec.loader.exec_module(module)
  return module


def _run(tmp_path, sections, timeout, extra=()):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  # A person's CPU run: one device, not the test session's 8 simulated ones.
  env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                              if not f.startswith("--xla_force_host_platform_device_count"))
  proc = subprocess.run([sys.executable, SCRIPT, "--small", "--sections", sections, "--out",
                         str(tmp_path), *extra], cwd=REPO, env=env, capture_output=True, text=True,
                        timeout=timeout)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  report = json.loads((tmp_path / "device_check.json").read_text())
  assert "INTERPRET" in report["header"] and report["small"]
  table = (tmp_path / "device_check.md").read_text()
  for row in report["rows"]:
    status = row["status"]
    assert status == "ok" or (status.startswith("skipped: ") and len(status) > len("skipped: ")), row
    if status == "ok" and row["tol"] is not None:
      assert row["err"] is not None and row["err"] <= row["tol"], row
    assert row["name"].replace("|", "\\|") in table
  return report["rows"]


@pytest.mark.slow
def test_cpu_small_kernels_and_attention(tmp_path):
  """The kernel sections: every quant kernel (the six rows that failed on the H200 first), the
  grouped matmul, bf16 MoE, attention at the training and prefill shapes, and the quantized sampler
  with the kernels against XLA. Slow (~60 s on an idle EPYC, ~110 s on a loaded Xeon): the kernels
  themselves are pinned by tests/test_quant_kernels.py and the attention tests, the script's row
  logic by the tests below."""
  rows = _run(tmp_path, "fixed,quant,gmm,moe_bf16,attention,sampler", timeout=400)
  names = [r["name"] for r in rows]
  dc = _load()
  assert names[:len(dc.FIXED_ROWS)] == list(dc.FIXED_ROWS)
  for op in ("quantize_rows", "dequantize_rows", "quantize_cols", "dequantize_cols", "qmatmul"):
    assert any(f"quant {op} " in n for n in names), op
  assert sum(n.startswith("gmm pallas") for n in names) == 3
  by_impl = {impl: [r for r in rows if r["name"].startswith(f"attention {impl} ")]
             for impl in ("blocked", "cudnn", "splash", "auto")}
  # Training shape fwd + fwd+bwd, prefill shape fwd.
  assert len(by_impl["blocked"]) == 3 and all(r["status"] == "ok" for r in by_impl["blocked"])
  assert len(by_impl["auto"]) == 3 and all(r["status"] == "ok" and "auto ran xla" in r["note"]
                                           for r in by_impl["auto"]), by_impl["auto"]
  # No GPU / TPU here: those impls are skipped with the attention module's own reason.
  assert len(by_impl["cudnn"]) == 3 and all("GPU" in r["status"] for r in by_impl["cudnn"])
  assert all("TPU" in r["status"] for r in by_impl["splash"])
  assert all(r["status"] == "ok" for r in rows if r["name"].startswith(("quant", "gmm", "moe_bf16")))
  assert sum(n.startswith("moe_bf16 ") for n in names) == 3
  sampler = [r for r in rows if r["name"].startswith("sampler ")]
  assert len(sampler) == 3 and all(r["status"] == "ok" and r["err"] <= r["tol"] for r in sampler), sampler


def test_cpu_default_sections_within_a_tiny_budget_skip_with_the_reason(tmp_path):
  """--budget: no row whose estimate passes the time left is started; every row is still listed."""
  rows = _run(tmp_path, ",".join(_load().PRIORITY), timeout=300,
              extra=("--budget", "1"))
  assert rows and all(r["status"].startswith("skipped: budget (estimate ") for r in rows), rows
  names = [r["name"] for r in rows]
  for prefix in ("quant", "sampler ", "sampler_peer", "moe_bf16", "attention", "calibration", "train_peer ",
                 "train_peer_bf16 "):
    assert any(n.startswith(prefix) for n in names), prefix


def test_budget_skips_rows_that_would_pass_it_and_runs_later_cheaper_ones(monkeypatch):
  dc = _load()
  now = [0.0]

  def row(seconds):
    def fn():
      now[0] += seconds
      return dict(time_s=seconds)
    return fn

  shared = {}  # a section's later rows read what its first computed: full cost until it exists
  monkeypatch.setattr(dc, "_gmm_rows", lambda sz, runs: [
      ("a", row(40)), ("b", row(50)), ("c", row(5)), ("d", row(5), 1.0),
      ("e", row(30), lambda: dc._paid_or_full(shared, 30))])
  costs = {"a": 40, "b": 50, "c": 5}
  seen = []
  rows = dc.run_checks(["gmm"], dc.SMALL, 1, log=lambda *_: None, on_row=lambda so_far: seen.append(len(so_far)),
                       budget_s=60, cost=costs.get, clock=lambda: now[0])
  assert [r.status for r in rows] == ["ok", "skipped: budget (estimate 50 s > 20 s left)", "ok", "ok",
                                      "skipped: budget (estimate 30 s > 10 s left)"]
  assert seen == [1, 2, 3, 4, 5]  # the table is written after every row, skipped ones included
  shared["rows"] = []
  assert dc._paid_or_full(shared, 30) == dc.PAID_ROW_COST_S
  assert dc.row_cost("quant quantize_cols fp4/32 e8m0") == dc.ROW_COST_S["quant quantize_cols"]
  assert dc.row_cost("attention blocked fwd+bwd train") == dc.ROW_COST_S["attention blocked fwd+bwd"]
  assert dc.row_cost("nothing known") == dc.DEFAULT_ROW_COST_S


@pytest.mark.slow
def test_cpu_small_rl(tmp_path):
  """The RL section (~1-2 min on 2 busy cores): zero mismatch of the fp32 sampler, 10 steps."""
  rows = _run(tmp_path, "rl", timeout=600)
  assert [r["status"] for r in rows] == ["ok", "ok"], rows
  assert rows[0]["err"] <= rows[0]["tol"]
  assert rows[1]["time_s"] > 0


def test_a_failing_row_does_not_stop_the_others(monkeypatch):
  dc = _load()

  def broken():
    raise RuntimeError("boom")

  def skipped():
    raise dc.Skip("not here")

  monkeypatch.setattr(dc, "_gmm_rows", lambda sz, runs: [("a", broken), ("b", skipped),
                                                         ("c", lambda: dict(err=2.0, tol=1.0)),
                                                         ("d", lambda: dict(err=0.5, tol=1.0))])

  def no_inputs(sz, runs):
    raise ValueError("no inputs")

  monkeypatch.setattr(dc, "_attention_rows", no_inputs)
  seen = []  # main writes the table after every row: a run cut short keeps what it finished
  rows = dc.run_checks(["gmm", "attention"], dc.SMALL, 1, log=lambda *_: None,
                       on_row=lambda so_far: seen.append(len(so_far)))
  assert seen == [1, 2, 3, 4, 5]
  assert [(r.name, r.status) for r in rows] == [
      ("a", "FAIL"), ("b", "skipped: not here"), ("c", "FAIL"), ("d", "ok"), ("attention", "FAIL")]
  assert "boom" in rows[0].note and "no inputs" in rows[4].note
  assert "| a | FAIL |" in dc.table(rows)
