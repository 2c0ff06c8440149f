"""The dry-run planner: abstract per-device bytes equal a real init's, the fit check fails clearly."""
import jax
import pytest

from rl_jax import job_sections
from rl_jax.plan import cli as plan_cli
from rl_jax.plan import config as plan_config
from rl_jax.plan import cost as plan_cost
from rl_jax.plan import hw as plan_hw
from rl_jax.plan import report as plan_report
from rl_jax.plan import state as plan_state
from rl_jax.plan import steps as plan_steps
from rl_jax import sharding as sh
from rl_jax import train_state
from rl_jax.configs import countdown_tiny
from rl_jax.optim import make_optimizer
from rl_jax.rl import run_state
from rl_jax.rl.job import RLJob
from rl_jax.study import sweeps

CONFIG = "configs/countdown_tiny.py:test"


def _mesh2():
  return sh.make_mesh(sh.MeshConfig(fsdp=2), jax.devices()[:2])


def _device0_bytes(tree, device) -> int:
  return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards if s.device == device)


def test_abstract_bytes_equal_real_init(fast_compile):
  config = countdown_tiny.get_config("test")  # AdamW: moments shaped like params + a scalar count
  job = RLJob.from_config(config)
  mesh = _mesh2()
  _, params_sds = plan_state.abstract_params(job.model, mesh)
  optimizer = make_optimizer(job.optim)
  opt_sds = plan_state.abstract_opt_state(optimizer, params_sds, mesh)
  _, params = train_state.init_params(job.model, job.seed, mesh)
  opt_state = train_state.init_opt_state(optimizer, params, mesh)
  d0 = mesh.devices.flat[0]
  # fsdp=2 splits the 64-wide model dimension: a real per-device figure, not the full size.
  full = sum(x.nbytes for x in jax.tree.leaves(params))
  assert plan_state.device_bytes(params_sds) == _device0_bytes(params, d0) < full
  assert plan_state.device_bytes(opt_sds) == _device0_bytes(opt_state, d0) > 0
  # AdamW's mu and nu are sharded like the params they mirror: exactly 2x the params per device
  # (+ the int32 step counts), not the full moments on every device.
  counts = [x for x in jax.tree.leaves(opt_sds) if x.ndim == 0]
  assert counts and all(x.dtype == "int32" for x in counts)
  assert plan_state.device_bytes(opt_sds) == 2 * plan_state.device_bytes(params_sds) + 4 * len(counts)
  assert plan_state.device_bytes(plan_state.opt_state_like_params(opt_sds, params_sds)) == plan_state.device_bytes(opt_sds)
  # The shardings themselves agree leaf by leaf.
  same = jax.tree.map(lambda a, b: a.sharding.is_equivalent_to(b.sharding, len(a.shape)), params_sds, params)
  assert all(jax.tree.leaves(same))


def test_xla_argument_bytes_are_per_device_and_fit_check_names_contributors(monkeypatch, capsys, fast_compile):
  config = countdown_tiny.get_config("test")
  mesh = _mesh2()
  plans, fits = plan_report.run(config, "h100", mesh=mesh, programs=("sync",), out=lambda _: None)
  (sync,) = plans
  # XLA's per-device argument size is the sharded params: the planner's own sum agrees.
  assert sync.argument == sync.args["params"] > 0
  assert fits == {"sync": None}
  # A device with 1000 bytes: the CLI exits 1 naming the program, the device and the largest
  # contributor (in-process: this session already has the devices, so no re-exec).
  monkeypatch.setitem(plan_hw.DEVICES, "tiny", plan_hw.Accelerator("tiny", 1e12, 1e12, 1000))
  monkeypatch.setenv("RL_JAX_PLAN_DEVICES", "2")
  assert plan_cli.main([f"--config={CONFIG}", "--devices=2", "--device=tiny", "--programs=sync"]) == 1
  err = capsys.readouterr().err
  assert "DOES NOT FIT: program 'sync' needs" in err and "tiny's" in err
  # AdamW's two moments (2x the params, sharded alike) are the largest term, named first.
  assert sync.resident["optimizer state"] >= 2 * sync.args["params"]
  assert f"largest: resident optimizer state {plan_hw.gib(sync.resident['optimizer state'])}" in err


def test_check_fit_and_roofline_closed_forms():
  acc = plan_hw.Accelerator("x", peak_flops=100.0, hbm_bw=10.0, hbm_bytes=2**30)
  assert plan_hw.roofline_s(1000.0, 10.0, acc) == 10.0   # compute-bound
  assert plan_hw.roofline_s(10.0, 1000.0, acc) == 100.0  # memory-bound
  assert plan_hw.check_fit("p", {"a": 2**29, "b": 2**29}, acc, mem_fraction=1.0) == 2**30
  with pytest.raises(plan_hw.DoesNotFit, match=r"needs 1\.00 GiB .* largest: b 768\.00 MiB, a 256\.00 MiB"):
    plan_hw.check_fit("p", {"a": 2**28, "b": 3 * 2**28 + 1}, acc, mem_fraction=1.0)
  # The usable share: 0.9 of the chip by default (the launch scripts' XLA_PYTHON_CLIENT_MEM_FRACTION).
  assert plan_hw.check_fit("p", {"a": int(0.9 * 2**30)}, acc) == int(0.9 * 2**30)
  with pytest.raises(plan_hw.DoesNotFit, match=r"> 0\.9 x x's 1\.00 GiB = 921\.60 MiB"):
    plan_hw.check_fit("p", {"a": int(0.9 * 2**30) + 1}, acc)
  # Collectives add bytes / bandwidth: the host's links within 8 chips, the network beyond.
  net = plan_hw.Accelerator("n", peak_flops=100.0, hbm_bw=10.0, hbm_bytes=2**30, link_bw=5.0, net_bw=1.0)
  assert plan_hw.roofline_s(1000.0, 10.0, net, comm_bytes=50.0, n_devices=8) == 10.0 + 10.0
  assert plan_hw.roofline_s(1000.0, 10.0, net, comm_bytes=50.0, n_devices=16) == 10.0 + 50.0


def test_layer_extrapolation_is_linear():
  a = plan_cost.ProgramPlan("u", args={"params": 10}, resident={}, temp=4, flops_xla=1.0)
  b = plan_cost.ProgramPlan("u", args={"params": 18}, resident={}, temp=6, flops_xla=3.0)
  c = plan_cost.extrapolate(a, b, 1, 2, 48)
  assert (c.args["params"], c.temp, c.flops_xla) == (10 + 8 * 47, 4 + 2 * 47, 1.0 + 2.0 * 47)


def test_collective_bytes_reads_every_collective_output_once():
  hlo = """
  %ag = bf16[8,128]{1,0} all-gather(bf16[2,128]{1,0} %x), replica_groups={{0,1,2,3}}, dimensions={0}
  %ars = (f32[16]{0}, f32[4,4]{1,0}) all-reduce-start(f32[16]{0} %a, f32[4,4]{1,0} %b), to_apply=%sum
  %rs = f32[2,3]{1,0} reduce-scatter(f32[8,3]{1,0} %y), dimensions={0}
  %dot = f32[64,64]{1,0} dot(f32[64,64]{1,0} %p, f32[64,64]{1,0} %q)
  """
  assert plan_cost.collective_bytes(hlo) == 8 * 128 * 2 + (16 + 16) * 4 + 6 * 4


def test_set_key_overrides_and_names_unknown_keys():
  config = countdown_tiny.get_config("test")
  plan_config.set_key(config, "model.scan_layers=True")
  plan_config.set_key(config, "model.moe_dispatch=shard_map")  # not a literal: kept as a string
  assert config.model.scan_layers is True and config.model.moe_dispatch == "shard_map"
  with pytest.raises(SystemExit, match="no section 'modle'"):
    plan_config.set_key(config, "modle.scan_layers=True")
  with pytest.raises(SystemExit, match="expected KEY=VALUE"):
    plan_config.set_key(config, "model.scan_layers")


@pytest.mark.parametrize("over,skipped", [
    ({}, {"old_forward"}),                                            # p_old from the update's forward
    ({"rl.p_old_in_update": False}, set()),
    ({"rl.n_minibatches": 2}, set()),                                 # N = 2: the separate forward runs
    ({"rl.p_old_version": "rollout", "rl.staleness": 2}, set()),  # p_old at the stale sampler's version
    ({"rl.eval_size": 0}, {"old_forward", "eval_greedy", "eval_sampled"}),
])
def test_default_programs_are_the_ones_the_trainer_runs(over, skipped):
  """The planner's default set follows the trainer: no separate p_old forward where the update
  computes p_old (RLJob.old_in_update), no evaluation at rl.eval_size=0."""
  config = countdown_tiny.get_config("test")
  for key, value in over.items():
    plan_config.set_key(config, f"{key}={value!r}" if isinstance(value, str) else f"{key}={value}")
  job = RLJob.from_config(config)
  assert job.old_in_update() == ("old_forward" in skipped)
  assert set(plan_config.PROGRAMS) - set(plan_config.default_programs(job)) == skipped


@pytest.mark.parametrize("dispatch", ["gspmd", "shard_map"])
def test_planner_compiles_both_moe_dispatches_in_the_mesh_context(dispatch, fast_compile):
  """The shard_map dispatch traces only under the mesh context, which `plan_step` enters; its
  analytic dispatch bytes are `dispatch_comm_bytes` per token x tokens x MoE layers."""
  from rl_jax.models import expert_parallel as ep_lib  # pylint: disable=g-import-not-at-top
  config = countdown_tiny.get_config("test")
  config.model.moe_dispatch = dispatch
  config.model.scan_layers = True
  mesh = sh.make_mesh(sh.MeshConfig(data=1, fsdp=1, expert=2, tensor=1), jax.devices()[:2])
  (_, old), _ = plan_report.run(config, "h100", mesh=mesh, programs=("sync", "old_forward"), out=lambda _: None)
  job = RLJob.from_config(config)
  m = job.model
  assert m.n_moe_layers > 0 and old.temp > 0
  tokens = job.rl.prompts_per_step * job.rl.group_size / 2 * (job.sampler.max_prompt_len + job.sampler.max_new_tokens)
  per_token = ep_lib.dispatch_comm_bytes(dispatch, tokens=1, d_model=m.d_model, n_experts=m.n_experts,
                                         top_k=m.n_experts_per_tok, expert_axis=2, batch_shards=2,
                                         act_bytes=4)["total"]
  assert old.comm_model == pytest.approx(per_token * tokens * m.n_moe_layers) and old.comm_model > 0
  if dispatch == "shard_map":  # the dispatch's all-gather / reduce-scatter are in the program
    assert old.comm_xla > 0


def _shapes(tree):
  return jax.tree.structure(tree), [(x.shape, x.dtype) for x in jax.tree.leaves(tree)]


def _derived_step_arguments_lower_like_the_trainers(tr):
  """`plan_steps.step_args` (the planner's batch: `jax.eval_shape` over the trainer's own `StepPrograms`
  methods) against the batch `tr` prepares from a real rollout: same structure, shapes and dtypes,
  and the same lowered text of the p_old forward, the update and the first-order meter."""
  progs = tr.programs
  _, ro = tr.rollout(0)
  rewards = jax.numpy.linspace(0.0, 1.0, ro.tokens_BS.shape[0])
  batch, _ = tr.prepare(ro, rewards)
  mb = next(tr.minibatches(batch))
  real = {"old_forward": (progs.learner.train_batch(ro, progs.learner.advantages(rewards)), ro.expert_ids_BSLK, ro.expert_valid_BS),
          "prepared": batch, "update": (mb,)}
  sds = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
  params, opt_state = (jax.tree.map(sds, tr.state[k]) for k in ("params", "opt_state"))
  with sh.mesh_context(tr.mesh):
    derived = plan_steps.step_args(progs, params, jax.tree.map(sds, tr.sampler_state), tr.mesh)
    for name in real:
      assert _shapes(derived[name]) == _shapes(real[name]), name
    text = {side: {"old_forward": progs.learner.lower_old_forward(params, *args["old_forward"]).as_text(),
                   "update": progs.learner.lower_update(params, opt_state, *args["update"]).as_text(),
                   "first_order": progs.learner.lower_first_order(params, *args["update"]).as_text()}
            for side, args in (("trainer", real), ("planner", derived))}
  for name, want in text["trainer"].items():
    assert text["planner"][name] == want, name
  return batch


def test_planner_compiles_the_programs_the_trainer_runs(tmp_path, fast_compile):
  """The planner lowers the trainer's own programs (rl_jax/rl/programs.py) on the trainer's mesh:
  for the `:test` config the compiled p_old forward and update, lowered from abstract shapes, are
  the trainer's, lowered from its real arrays in the mesh context its loop runs them in (same
  fingerprint of the compiled HLO). Its batch is derived, not built: `plan_steps.step_args` has the
  trainer's structure, shapes and dtypes and lowers the p_old forward, the update and the meter
  to the trainer's program text (`_derived_step_arguments_lower_like_the_trainers`)."""
  from rl_jax.rl.trainer import RLTrainer  # pylint: disable=g-import-not-at-top
  config = countdown_tiny.get_config("test")
  config.warm_start.source = "none"
  with RLTrainer(config, str(tmp_path / "run")) as tr:
    _derived_step_arguments_lower_like_the_trainers(tr)
    _, ro = tr.rollout(0)
    batch, _ = tr.prepare(ro, jax.numpy.linspace(0.0, 1.0, ro.tokens_BS.shape[0]))
    sampler_ids = ro.expert_ids_BSLK if tr.job.model.is_moe else None
    raw = batch.replace(logp_old_BT=None, replay_ids_BSLK=None, replay_mask_BS=None)
    with sh.mesh_context(tr.mesh):
      lowered = {"old_forward": tr.programs.learner.old_forward.lower(tr.state["params"], raw, sampler_ids,
                                                              ro.expert_valid_BS),
                 "update": tr.programs.learner.update.lower(tr.state["params"], tr.state["opt_state"], batch)}
    want = {k: plan_cost.fingerprint(v.compile()) for k, v in lowered.items()}
    plans = plan_steps.plan_step(tr.job, tr.mesh, programs=("old_forward", "update"))
  assert {p.name: p.fingerprint for p in plans} == want


@pytest.mark.slow  # ~10 s; the default case (no replay, one mini-batch) is in the test above
def test_planner_derives_the_trainers_step_arguments_under_r2(tmp_path, fast_compile):
  """R2 at N = 2 mini-batches: the prepared batch carries theta_old's own expert ids (in the p_old
  forward's dtype), derived by the planner through the same `StepPrograms.prepare` (`with_replay`),
  and each mini-batch keeps its rows over the batch axes (`programs._minibatch`), so the update the
  trainer lowers is the planner's."""
  from rl_jax.rl.trainer import RLTrainer  # pylint: disable=g-import-not-at-top
  config = countdown_tiny.get_config("test")
  config.warm_start.source = "none"
  config.rl.routing_replay = "R2"
  config.rl.prompts_per_step, config.rl.n_minibatches = 8, 2   # 8 rows per mini-batch over 8 devices
  with RLTrainer(config, str(tmp_path / "run")) as tr:
    batch = _derived_step_arguments_lower_like_the_trainers(tr)
    mbs = list(tr.minibatches(batch))
  assert batch.replay_ids_BSLK is not None and len(mbs) == 2
  for mb in mbs:     # rows split over the batch axes, not replicated on every device
    assert mb.tokens_BS.sharding.is_equivalent_to(sh.batch_sharding(tr.mesh, 2), 2)
    assert mb.tokens_BS.sharding.shard_shape(mb.tokens_BS.shape)[0] < mb.tokens_BS.shape[0]


def test_async_split_plans_each_group_on_its_own_devices(fast_compile):
  """rl.mode='async' with mesh.sampler_devices: the sampler's programs compile on its 4 devices and
  hold only its weights; the trainer's on the other 4, without the sampler's weights; the step's
  roofline is the slower group's."""
  config = countdown_tiny.get_config("test")
  config.rl.mode, config.mesh.sampler_devices = "async", 4
  lines = []
  plans, fits = plan_report.run(config, "h100", 8, programs=("sync", "generate", "update"), out=lines.append)
  by = {p.name: p for p in plans}
  assert set(by) == {"sync", "generate", "update"} and all(m is None for m in fits.values())
  assert by["generate"].resident == {} and "params" not in by["sync"].resident
  assert "sampler weights" not in by["update"].resident and "params" in by["update"].args
  text = "\n".join(lines)
  assert "sampler (sync, generate) data=1, fsdp=4" in text and "max(sampler" in text, text


def test_substitutions_name_what_a_gpu_runs_in_place_of_the_cpu_compile():
  """From the choices the traces recorded (rl_jax.impl_log): attention per call shape re-resolved
  for the device, quantized linears and experts, each with what XLA:CPU compiled instead."""
  from rl_jax import impl_log  # pylint: disable=g-import-not-at-top
  config = countdown_tiny.get_config("test")
  config.model.dtype = "bfloat16"
  config.sampler.dtype = "bfloat16"
  config.sampler.quant = "fp8_wa_fp8_kv"
  job = RLJob.from_config(config)
  train = impl_log.describe(dtype="bfloat16", layout="bcgd", b=8, s=36, c=36, heads=2, head_dim=32,
                            static_zero_offset=True, static_offset=True, causal=True)
  prefill = impl_log.describe(dtype="bfloat16", layout="cache", b=8, s=23, c=36, heads=2, head_dim=32,
                              static_zero_offset=True, static_offset=True, causal=True)
  log = {"attention_call": {train: 2, prefill: 1}, "attention": {"xla": 3},
         "quantized_linear": {"xla dequantize + float32 dot": 5},
         "experts": {"quantized ragged_dot float32": 3, "slab bfloat16": 2}}
  subs = plan_report.substitutions(log, job, "h200")
  assert subs[0].startswith("attention cudnn x2 on h200 (distinct call shapes), compiled here as xla")
  assert "float32 copies" in subs[0]
  assert subs[1] == "quantized linears pallas qmatmul on h200, compiled here as xla dequantize + float32 dot"
  assert subs[2] == ("quantized experts quantized grouped bfloat16 on h200, compiled here as "
                     "quantized ragged_dot float32")
  assert subs[3].startswith("experts expert matmul grouped on h200") and "slab bfloat16" in subs[3]
  # On a TPU: splash for both call shapes (static offsets), and ragged_dot for the experts.
  tpu = plan_report.substitutions(log, job, "tpu_v5p")
  assert tpu[0].startswith("attention splash x2 on tpu_v5p")
  assert "quantized ragged_dot bfloat16 on tpu_v5p" in tpu[2]


def test_kv_cache_sizing_is_the_cache_and_its_product():
  """The continuous engine's KV cache on the 30B `:n4_32k` config: 128 slots over a 16-device mesh
  (data 1 x fsdp 2 x expert 8), each slot S = 256 + 32768 cache slots x 48 layers x 2 (K, V) x 4 kv
  heads x 128 head dim x 1 byte (FP8), plus the format's scales: the figure is that product, and it
  is the bytes `init_cache` allocates for those rows (divided over the devices)."""
  import types  # pylint: disable=g-import-not-at-top
  from rl_jax.configs import qwen3_30b_a3b_minirl  # pylint: disable=g-import-not-at-top
  from rl_jax.models.kv_cache import init_cache  # pylint: disable=g-import-not-at-top
  from rl_jax.models.layers import dtype_of  # pylint: disable=g-import-not-at-top
  from rl_jax.models import ModelConfig  # pylint: disable=g-import-not-at-top
  from rl_jax.sampler.config import sampler_config  # pylint: disable=g-import-not-at-top
  config = qwen3_30b_a3b_minirl.get_config("n4_32k")
  config.sampler.engine = "continuous"
  m, s = job_sections.section(config, "model", ModelConfig), sampler_config(config.sampler)
  mesh = types.SimpleNamespace(shape=dict(data=1, fsdp=2, expert=8, tensor=1))
  total, text = plan_state.kv_cache_sizing(m, s, 128, s.quant.kv, mesh)
  cache = jax.eval_shape(lambda: init_cache(m, 128, s.max_len, dtype_of(s.dtype), s.quant.kv))
  assert total * 16 == sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))
  values = 8 * 33024 * 48 * 2 * 4 * 128 * 1
  assert values < total < 1.2 * values   # the scales on top
  assert text.startswith("8 rows per device (128 over 16) x S 33024 (P 256 + T 32768) x 48 layers x 2 (K, V) x "
                         "4 kv heads x 128 head dim x 1 B (fp8"), text


@pytest.mark.parametrize("overrides,extra", [
    ({}, set()),
    ({"rl.staleness": 2}, {"sampler_src"}),
    # The planner's own list once counted the copy only under staleness (issue 55).
    ({"rl.mode": "async", "rl.stale_policy": "drop", "rl.sampler_sync_every": 2}, {"sampler_src"}),
    ({"sampler.noise": "relative", "sampler.noise_sigma": 0.01}, {"noise"}),
])
def test_the_planner_counts_the_run_state_the_trainer_holds(overrides, extra):
  """The planner's resident copies are `jax.eval_shape` of the trainer's own (`run_state.copies`,
  what `init_state` adds to the params and optimizer state): the same entries, each with the
  per-device bytes of the real one."""
  job = RLJob.from_config(sweeps.apply_overrides(countdown_tiny.get_config("test"), overrides))
  mesh = _mesh2()
  optimizer = make_optimizer(job.optim)
  held = run_state.init_state(job, train_state.init_params(job.model, 0, mesh)[1], optimizer, mesh)
  counted = plan_steps.resident_state(job, plan_state.abstract_params(job.model, mesh)[1])
  assert set(held) == {"params", "opt_state"} | extra and set(counted) == extra
  d0 = jax.devices()[0]
  for k, v in counted.items():
    assert plan_state.device_bytes(v) == _device0_bytes(held[k], d0) > 0, k
