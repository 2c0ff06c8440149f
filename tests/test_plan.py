"""The dry-run planner: abstract per-device bytes equal a real init's, the fit check fails clearly."""
import jax
import pytest

from configs import countdown_tiny
from rl_jax import experiment as ex
from rl_jax import plan
from rl_jax import plan_hw
from rl_jax import sharding as sh
from rl_jax.optim import make_optimizer
from rl_jax.rl.job import RLJob

CONFIG = "configs/countdown_tiny.py:test"


def _mesh2():
  return sh.make_mesh(sh.MeshConfig(fsdp=2), jax.devices()[:2])


def _device0_bytes(tree, device) -> int:
  return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards if s.device == device)


def test_abstract_bytes_equal_real_init(fast_compile):
  config = countdown_tiny.get_config("test")  # AdamW: moments shaped like params + a scalar count
  job = RLJob.from_config(config)
  mesh = _mesh2()
  _, params_sds = plan.abstract_params(job.model, mesh)
  optimizer = make_optimizer(job.optim)
  opt_sds = plan.abstract_opt_state(optimizer, params_sds, mesh)
  _, params = ex.init_params(job.model, job.seed, mesh)
  opt_state = ex.init_opt_state(optimizer, params, mesh)
  d0 = mesh.devices.flat[0]
  # fsdp=2 splits the 64-wide model dimension: a real per-device figure, not the full size.
  full = sum(x.nbytes for x in jax.tree.leaves(params))
  assert plan.device_bytes(params_sds) == _device0_bytes(params, d0) < full
  assert plan.device_bytes(opt_sds) == _device0_bytes(opt_state, d0) > 0
  # AdamW's mu and nu are sharded like the params they mirror: exactly 2x the params per device
  # (+ the int32 step counts), not the full moments on every device.
  counts = [x for x in jax.tree.leaves(opt_sds) if x.ndim == 0]
  assert counts and all(x.dtype == "int32" for x in counts)
  assert plan.device_bytes(opt_sds) == 2 * plan.device_bytes(params_sds) + 4 * len(counts)
  assert plan.device_bytes(plan.opt_state_like_params(opt_sds, params_sds)) == plan.device_bytes(opt_sds)
  # The shardings themselves agree leaf by leaf.
  same = jax.tree.map(lambda a, b: a.sharding.is_equivalent_to(b.sharding, len(a.shape)), params_sds, params)
  assert all(jax.tree.leaves(same))


def test_xla_argument_bytes_are_per_device_and_fit_check_names_contributors(monkeypatch, capsys, fast_compile):
  config = countdown_tiny.get_config("test")
  mesh = _mesh2()
  plans, fits = plan.run(config, "h100", mesh=mesh, programs=("sync",), out=lambda _: None)
  (sync,) = plans
  # XLA's per-device argument size is the sharded params: the planner's own sum agrees.
  assert sync.argument == sync.args["params"] > 0
  assert fits == {"sync": None}
  # A device with 1000 bytes: the CLI exits 1 naming the program, the device and the largest
  # contributor (in-process: this session already has the devices, so no re-exec).
  monkeypatch.setitem(plan_hw.DEVICES, "tiny", plan_hw.Accelerator("tiny", 1e12, 1e12, 1000))
  monkeypatch.setenv("RL_JAX_PLAN_DEVICES", "2")
  assert plan.main([f"--config={CONFIG}", "--devices=2", "--device=tiny", "--programs=sync"]) == 1
  err = capsys.readouterr().err
  assert "DOES NOT FIT: program 'sync' needs" in err and "tiny's" in err
  # AdamW's two moments (2x the params, sharded alike) are the largest term, named first.
  assert sync.resident["optimizer state"] >= 2 * sync.args["params"]
  assert f"largest: resident optimizer state {plan_hw.gib(sync.resident['optimizer state'])}" in err


def test_check_fit_and_roofline_closed_forms():
  acc = plan_hw.Accelerator("x", peak_flops=100.0, hbm_bw=10.0, hbm_bytes=2**30)
  assert plan_hw.roofline_s(1000.0, 10.0, acc) == 10.0   # compute-bound
  assert plan_hw.roofline_s(10.0, 1000.0, acc) == 100.0  # memory-bound
  assert plan_hw.check_fit("p", {"a": 2**29, "b": 2**29}, acc) == 2**30
  with pytest.raises(plan_hw.DoesNotFit, match=r"needs 1\.00 GiB .* largest: b 768\.00 MiB, a 256\.00 MiB"):
    plan_hw.check_fit("p", {"a": 2**28, "b": 3 * 2**28 + 1}, acc)


def test_layer_extrapolation_is_linear():
  a = plan.ProgramPlan("u", args={"params": 10}, resident={}, temp=4, flops_xla=1.0)
  b = plan.ProgramPlan("u", args={"params": 18}, resident={}, temp=6, flops_xla=3.0)
  c = plan.extrapolate(a, b, 1, 2, 48)
  assert (c.args["params"], c.temp, c.flops_xla) == (10 + 8 * 47, 4 + 2 * 47, 1.0 + 2.0 * 47)
