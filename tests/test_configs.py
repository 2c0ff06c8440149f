"""Every config and sweep run resolves and validates; the GPU-scale configs' models and meshes, abstractly."""
import dataclasses
import functools
import glob
import importlib
import math
import os
import re
import shlex
import subprocess
import sys

import jax
import numpy as np
import pytest
from absl import flags
from jax.sharding import AbstractMesh, PartitionSpec as P
from ml_collections import config_flags

from rl_jax import config_schema
from rl_jax import sharding as sh
from rl_jax import train_state
from rl_jax import workdir as wd
from rl_jax.config_utils import ConfigError
from rl_jax.configs import countdown_tiny
from rl_jax.configs import qwen3_30b_a3b_minirl
from rl_jax.models import hf
from rl_jax.models import quantize as quant_params
from rl_jax.models.config import EXECUTION_FIELDS, ModelConfig
from rl_jax.models.presets import PRESETS, abstract_state
from rl_jax.ops import kv_quant as qkv
from rl_jax.rl.loss.loss_config import METHODS
from rl_jax.rl.trainer import RLJob
from rl_jax.sampler import generate as gen
from rl_jax.sampler import weights as sampler_weights
from rl_jax.sft import SFTJob
from rl_jax.study import sweeps

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOT_CONFIGS = {"__init__.py", "common.py"}

ALL_SWEEP_ARGS = [f"{s}/{name}" for s, fn in sweeps.SWEEPS.items() for name, _ in fn()]
# Every config file with every arg its docstring documents (None = no arg). A new file in
# configs/ must be listed here, and an arg its docstring shows must be too.
CONFIG_ARGS = {
    "countdown_tiny.py": [None, "test"],
    "countdown_tiny_sharp.py": [None, "test"],
    "sft_countdown_tiny.py": [None, "test"],
    "qwen3_0p6b_countdown.py": [None, "/ckpt/Qwen3-0.6B", "long", "long:/ckpt/Qwen3-0.6B"],
    "qwen3_30b_a3b_minirl.py": [None] + [f"n{n}" for n in qwen3_30b_a3b_minirl.N_CHOICES] + ["n4_32k"],
    "math_tiny.py": [None, "test", "demo"],
    "qwen3_30b_a3b_math.py": [None, "minirl"] + [f"minirl_n{n}" for n in qwen3_30b_a3b_minirl.N_CHOICES],
    "sweeps.py": ALL_SWEEP_ARGS,
}
# Devices each GPU-scale config is laid out for (its docstring's hardware).
GPU_CONFIGS = {"qwen3_0p6b_countdown.py": ("qwen3-0.6b", 8, 0.596e9),
               "qwen3_30b_a3b_minirl.py": ("qwen3-30b-a3b", 32, 30.5e9),
               "qwen3_30b_a3b_math.py": ("qwen3-30b-a3b", 32, 30.5e9)}


def _module(fname):
  return importlib.import_module(f"rl_jax.configs.{fname[:-3]}")


def _validate(config):
  job = {"rl": RLJob, "sft": SFTJob}[config.job]
  return job.from_config(config)


@functools.lru_cache(maxsize=None)
def _abstract(model_cfg):
  return abstract_state(model_cfg)


def _check_sampler_fits(job: RLJob, trace: bool = True) -> None:
  """What sync_weights / the KV cache would reject at run time, checked on abstract shapes (no memory).

  RLJob.from_config does not see parameter shapes: block sizes of the sampler's quantization
  must divide the model's contraction dims and head_dim. `trace` runs the real sync under
  `jax.eval_shape`; without it only its shape check (`check_weight`) runs, which is all a
  channel-scaled format needs and is fast for the 30B model.
  """
  state = _abstract(job.model)
  q = job.sampler.quant
  if trace:
    jax.eval_shape(lambda s: sampler_weights.sync_weights(s, None, q, job.sampler.dtype), state)
  elif q.weights.quantized:
    for path, var in _flat_vars(state):
      if path.rsplit("/", 1)[-1] in quant_params.QUANTIZED_NAMES:
        quant_params.check_weight(path, tuple(var.get_value().shape), q)
  if q.kv.quantized:
    m = job.model
    x = jax.ShapeDtypeStruct((1, 1, m.n_kv_heads, m.head_dim), np.float32)
    jax.eval_shape(lambda x: qkv.kv_quantize(x, q.kv, backend="xla"), x)


def _check_batches(job, n_devices: int) -> None:
  """RLTrainer's batch checks against a mesh of `n_devices`, without building it."""
  n_devices = getattr(job.mesh, "num_devices", 0) or n_devices
  sizes = dict(zip(sh.MESH_AXES, job.mesh.resolve(n_devices)))
  div = math.prod(sizes[a] for a in sh.BATCH_AXES)
  r = job.rl
  assert (r.prompts_per_step // r.n_minibatches) * r.group_size % div == 0, (r, sizes)
  assert r.eval_size % div == 0, (r.eval_size, sizes)


def test_config_files_are_listed_with_their_documented_args():
  files = {os.path.basename(p) for p in glob.glob(os.path.join(REPO, "configs", "*.py"))} - NOT_CONFIGS
  assert files == set(CONFIG_ARGS), "list new configs (and their args) in CONFIG_ARGS"
  for fname in files - {"sweeps.py"}:
    doc = _module(fname).__doc__
    assert doc and "Command" in doc and "Hardware" in doc and "xpected" in doc, fname
    documented = set(re.findall(r"`:([\w./-]+)`", doc))
    documented |= set(re.findall(re.escape(fname) + r":([\w./-]+)", doc))
    assert documented <= set(CONFIG_ARGS[fname]), (fname, documented)


@pytest.mark.parametrize("fname,arg", [(f, a) for f, args in CONFIG_ARGS.items() for a in args
                                       if f != "sweeps.py"])
def test_config_resolves_and_validates(fname, arg):
  config = _module(fname).get_config(arg)
  job = _validate(config)
  # Every scalar key of the job's schema is listed, so `--config.SECTION.KEY=V` can override it.
  missing = [k for k in config_schema.defaults(config.job)
             if k.split(".")[0] in config and k.split(".")[1] not in config[k.split(".")[0]]]
  assert not missing, (fname, missing)
  if isinstance(job, RLJob):
    _check_sampler_fits(job, trace=fname not in GPU_CONFIGS)
    n_devices = GPU_CONFIGS[fname][1] if fname in GPU_CONFIGS else jax.device_count()
    _check_batches(job, n_devices)


def test_a_key_left_out_means_its_default_on_resume():
  """A workdir whose stored config predates a schema key resumes when the new config sets that key
  to its default, and refuses when it sets another value."""
  stored = {"job": "rl", "rl": {"steps": 3}}
  defaults = config_schema.defaults("rl")
  assert wd.config_diff(stored, {"job": "rl", "rl": {"steps": 3, "mode": "sync"}}, defaults) == []
  assert wd.config_diff(stored, {"job": "rl", "rl": {"steps": 3, "mode": "async"}}, defaults) == [
      ("rl.mode", "sync", "async")]
  assert wd.config_diff(stored, {"job": "rl", "rl": {"steps": 3, "mode": "sync"}}) == [
      ("rl.mode", "<absent>", "sync")]


@pytest.mark.parametrize("flag,message", [
    ("--config.rl.metre_every=2", "unknown config key(s) 'rl.metre_every' (closest: rl.meter_every"),
    ("--config.rl.mode=asink", "config key 'rl.mode': 'asink' is not one of ['sync', 'async']"),
])
def test_command_line_errors_are_one_line_with_the_key_and_exit_2(tmp_path, flag, message):
  r = subprocess.run([sys.executable, "-m", "rl_jax.main", "--config=configs/countdown_tiny.py:test",
                      f"--workdir={tmp_path / 'run'}", "--config.warm_start.source=none", flag],
                     cwd=REPO, capture_output=True, text=True, timeout=300,
                     env=dict(os.environ, JAX_PLATFORMS="cpu", RL_JAX_TRACEBACK=""))
  assert r.returncode == 2, r.stderr[-3000:]
  assert message in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]
  assert len([l for l in r.stderr.splitlines() if l.startswith("config error")]) == 1


def test_long_response_variants_change_memory_settings_only():
  """`long` / `nN_32k` differ from the base config only in response length and the memory knobs
  (micro-batches, waves, prefill rows, MoE chunks, and the 32K variant's mesh): the same RL."""
  memory_keys = {"sampler.max_new_tokens", "sampler.prefill_rows", "sampler.max_rows_in_flight",
                 "rl.forward_microbatch", "rl.update_microbatch", "rl.eval_rows_in_flight",
                 "model.moe_seq_chunk", "mesh.fsdp", "mesh.num_devices", "logging.run_name"}
  for fname, base_arg, long_arg in (("qwen3_0p6b_countdown.py", "/ckpt/q", "long:/ckpt/q"),
                                    ("qwen3_30b_a3b_minirl.py", "n4", "n4_32k")):
    base, long = (_module(fname).get_config(a).to_dict() for a in (base_arg, long_arg))
    flat = lambda d: {f"{s}.{k}": v for s, sec in d.items() if isinstance(sec, dict) for k, v in sec.items()}
    changed = {k for k, v in flat(long).items() if flat(base)[k] != v}
    assert "sampler.max_new_tokens" in changed and changed <= memory_keys, (fname, changed)
  job = RLJob.from_config(qwen3_30b_a3b_minirl.get_config("n4_32k"))
  assert job.sampler.max_new_tokens == 32768 and job.mesh.num_devices == 16
  _check_batches(job, 16)
  assert _module("qwen3_0p6b_countdown.py").get_config("long").warm_start.path == ""


def test_unknown_config_args_fail():
  with pytest.raises(ValueError, match="n3"):
    qwen3_30b_a3b_minirl.get_config("n3")
  with pytest.raises(ValueError, match="SWEEP/NAME"):
    sweeps.get_config("mismatch")
  with pytest.raises(KeyError, match="nope"):
    sweeps.get_config("mismatch/nope")
  with pytest.raises(ConfigError, match="loss.typo"):
    RLJob.from_config(sweeps.apply_overrides(countdown_tiny.get_config(), {"loss.typo": 1}))
  with pytest.raises(ConfigError, match="loss.sampling_mask.*sampler.top_k=0, sampler.top_p=1.0"):
    RLJob.from_config(sweeps.apply_overrides(countdown_tiny.get_config(), {"loss.sampling_mask": "kept_set"}))
  RLJob.from_config(sweeps.apply_overrides(countdown_tiny.get_config(), {"loss.sampling_mask": "kept_set",
                                                                          "sampler.top_p": 0.9}))
  # Weight normalization needs the whole mini-batch in one loss call (docs/math.md#weight-normalization).
  mesh = sh.make_mesh(sh.MeshConfig(data=1, fsdp=-1), jax.devices()[:1])
  wn = {"loss.weight_norm": True, "rl.update_microbatch": 64}
  with pytest.raises(ConfigError, match="loss.weight_norm.*rl.update_microbatch=64"):
    RLJob.from_config(sweeps.apply_overrides(countdown_tiny.get_config(), wn)).microbatch_counts(mesh)
  wn["rl.update_microbatch"] = 0
  RLJob.from_config(sweeps.apply_overrides(countdown_tiny.get_config(), wn)).microbatch_counts(mesh)


def test_sweep_runs_validate():
  seen = 0
  for sweep, fn in sweeps.SWEEPS.items():
    runs = fn()
    names = [n for n, _ in runs]
    assert len(set(names)) == len(names), (sweep, names)
    for name, _ in runs:
      config = sweeps.get_config(f"{sweep}/{name}")  # = countdown_tiny + the run's overrides
      try:
        job = _validate(config)
        _check_sampler_fits(job)
        _check_batches(job, jax.device_count())
      except Exception as e:
        raise AssertionError(f"sweep {sweep} run {name}: {e}") from e
      seen += 1
  assert seen == len(ALL_SWEEP_ARGS)


def test_sweeps_cover_spec():
  assert {o["loss.method"] for _, o in sweeps.methods()} == set(METHODS)
  ab = dict(sweeps.minirl_ablations())
  assert ab["no_train_infer_is"]["loss.minirl_train_infer_is"] is False
  assert ab["length_norm"]["loss.aggregation"] == "seq_mean" and ab["no_clip"]["loss.minirl_clip"] is False
  sc = {(o["loss.method"], o["loss.score_centering"]) for _, o in sweeps.score_centering()}
  assert {("pg", "none"), ("pg", "topk"), ("pg", "full"), ("tis", "topk"), ("mis", "topk")} <= sc
  mm = dict(sweeps.mismatch())
  jobs = {n: RLJob.from_config(sweeps.apply_overrides(countdown_tiny.get_config(), o)) for n, o in mm.items()}
  kv = {n: j.sampler.quant.kv.format for n, j in jobs.items()}
  w = {n: j.sampler.quant.weights.format for n, j in jobs.items()}
  a = {n: j.sampler.quant.activations.format for n, j in jobs.items()}
  assert (w["fp8_wa_fp8_kv"], a["fp8_wa_fp8_kv"], kv["fp8_wa_fp8_kv"]) == ("fp8", "fp8", "fp8")
  assert (w["fp8_wa_fp4_kv"], a["fp8_wa_fp4_kv"], kv["fp8_wa_fp4_kv"]) == ("fp8", "fp8", "fp4")
  assert (w["int8_wa_int4_kv"], a["int8_wa_int4_kv"], kv["int8_wa_int4_kv"]) == ("int8", "int8", "int4")
  assert (w["int8_wa_int8_kv"], a["int8_wa_int8_kv"], kv["int8_wa_int8_kv"]) == ("int8", "int8", "int8")
  assert (w["int4_w"], a["int4_w"], w["fp4_w"], a["fp4_w"]) == ("int4", "fp32", "fp4", "fp32")
  assert {jobs[f"noise_{s}"].sampler.noise_sigma for s in (0.01, 0.02, 0.05)} == {0.01, 0.02, 0.05}
  assert all(jobs[f"noise_{s}"].sampler.noise == "relative" for s in (0.01, 0.02, 0.05))
  assert jobs["stale_64"].rl.staleness == 64 and jobs["stale_64"].rl.steps > 64
  off = {o["rl.n_minibatches"]: o["rl.routing_replay"] for _, o in sweeps.off_policy()}
  assert off == {1: "none", 2: "R2", 4: "R3", 8: "R3"}
  assert {o["rl.routing_replay"] for _, o in sweeps.replay()} == {"none", "R2", "R3"}


def _parse_command(line: str):
  """Runs a printed command's flags through ml_collections' parser, as rl_jax.main would."""
  argv = shlex.split(line)
  assert argv[:3] == ["python", "-m", "rl_jax.main"], line
  argv = ["main"] + argv[3:]
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "", flag_values=fv, lock_config=True, sys_argv=argv)
  flags.DEFINE_string("workdir", None, "", flag_values=fv)
  fv(argv)
  return fv.config, fv.workdir


def test_sweep_commands_parse_to_the_validated_configs(monkeypatch):
  monkeypatch.chdir(REPO)  # the commands name config files relative to the repository root
  file_form = set()
  for sweep, fn in sweeps.SWEEPS.items():
    lines = sweeps.commands(sweep, root="/tmp/r", warm_start="/tmp/ws")
    for (name, overrides), line in zip(fn(), lines):
      config, workdir = _parse_command(line)
      want = sweeps.apply_overrides(countdown_tiny.get_config(), overrides)
      want.warm_start.path = "/tmp/ws"
      assert workdir == f"/tmp/r/{sweep}/{name}"
      assert config.to_dict() == want.to_dict(), line
      if "configs/sweeps.py:" in line:
        file_form.add(f"{sweep}/{name}")
  # Only quantization regimes whose block sizes need a nested section (not a preset name)
  # need the sweeps.py form; everything else is a plain --config.a.b=v flag.
  sections = ("fp8_wa_fp4_kv", "int4_w", "fp4_wa_fp4_kv")
  assert file_form == {*(f"mismatch/{r}" for r in sections),
                       *(f"regimes_x_corrections/{r}/{c}" for r in sections
                         for c in ("pg", "tis", "mis", "sc", "sc_tis", "sc_mis"))}


def test_sweeps_cli_prints_one_line_per_run(capsys):
  assert sweeps.main(["off_policy", "--root=/x"]) == 0
  lines = capsys.readouterr().out.strip().splitlines()
  assert len(lines) == 4 and all(l.startswith("python -m rl_jax.main --config=configs/countdown_tiny.py "
                                               "--workdir=/x/off_policy/n") for l in lines)
  assert "--config.rl.n_minibatches=8 --config.rl.routing_replay=R3" in lines[-1]


# -- GPU-scale configs: models, parameter counts and mesh layouts, all abstract ------------------

@pytest.mark.parametrize("fname", list(GPU_CONFIGS))
def test_gpu_config_model_is_the_preset(fname):
  preset, _, approx = GPU_CONFIGS[fname]
  job = RLJob.from_config(_module(fname).get_config())
  ref = PRESETS[preset]
  # Same architecture as the checkpoint's config.json; only precision / remat, the parameter
  # layout (scanned layers, on for the pod configs) and the kernels / dispatch are job choices.
  assert job.model.scan_layers
  choices = EXECUTION_FIELDS
  assert dataclasses.replace(job.model, **{k: getattr(ref, k) for k in choices}) == ref
  assert hf.hf_to_model_config(hf.model_config_to_hf(ref), **{k: getattr(job.model, k) for k in choices}
                               ) == job.model
  assert job.model.dtype == "bfloat16" and job.sampler.quant.weights.format == "fp8"
  state = _abstract(job.model)  # nnx.eval_shape: nothing allocated
  total = sum(math.prod(x.shape) for x in jax.tree.leaves(state))
  assert abs(total - approx) / approx < 0.01, total


def test_expert_matmul_is_in_every_config_and_survives_hf_loading():
  """Every config's model section lists model.expert_matmul (common.complete), the 30B one states
  "auto" (grouped on its GPUs), and an HF warm start's config keeps a non-default value."""
  for fname in GPU_CONFIGS:
    assert _module(fname).get_config().model.expert_matmul == "auto", fname
  job = RLJob.from_config(qwen3_30b_a3b_minirl.get_config())
  assert job.model.expert_matmul == "auto"
  from rl_jax.plan import report as plan_report  # pylint: disable=g-import-not-at-top
  # The planner states the assumption of its figures (and what XLA:CPU compiled instead).
  assert plan_report.expert_matmul_note(job.model, "h200") == (
      "expert matmul grouped on h200 (model.expert_matmul=auto), compiled here as slab")
  assert plan_report.expert_matmul_note(job.model, "tpu_v5p").startswith("expert matmul ragged_dot on tpu_v5p")
  ref = PRESETS["qwen3-30b-a3b"]
  assert hf.hf_to_model_config(hf.model_config_to_hf(ref), expert_matmul="grouped").expert_matmul == "grouped"
  with pytest.raises(hf.CheckpointError, match="model.expert_matmul"):
    hf.hf_to_model_config(hf.model_config_to_hf(ref), expert_matmul="dense")


# Every execution field off its default in one of the two models (the zero-mismatch mode refuses
# the grouped kernel, so it gets a model of its own).
_EXECUTION_CHOICES = (
    dict(dtype="bfloat16", param_dtype="bfloat16", remat=True, router_aux_loss_coef=1e-3,
         scan_layers=True, moe_dispatch="shard_map", moe_a2a="ragged", expert_matmul="grouped",
         moe_seq_chunk=8, attention="blocked"),
    dict(batch_invariant=True, expert_matmul="slab", attention="xla"),
)


@pytest.mark.parametrize("choices", _EXECUTION_CHOICES, ids=["kernels", "batch_invariant"])
def test_an_hf_warm_start_keeps_every_execution_choice(choices, tmp_path):
  """rl/warm_start.py hands the job's EXECUTION_FIELDS to the HF loader: a job whose model section
  sets any of them loads the checkpoint instead of failing "differs from the HF checkpoint"."""
  import types  # pylint: disable=g-import-not-at-top
  from rl_jax.models.families import build_model  # pylint: disable=g-import-not-at-top
  from rl_jax.rl import warm_start as ws_lib  # pylint: disable=g-import-not-at-top
  default = ModelConfig()
  changed = set().union(*(c.keys() for c in _EXECUTION_CHOICES))
  assert changed == set(EXECUTION_FIELDS), "every execution field must be tried off its default"
  arch = ModelConfig(n_experts=4, n_experts_per_tok=2)
  hf.save_hf_checkpoint(build_model(arch, 0), str(tmp_path / "ckpt"))
  model_cfg = dataclasses.replace(arch, **choices)
  assert all(getattr(model_cfg, k) != getattr(default, k) for k in choices)
  job = types.SimpleNamespace(model=model_cfg, seed=0,
                              warm_start=types.SimpleNamespace(source="hf", path=str(tmp_path / "ckpt")))
  graphdef, params = ws_lib.warm_start(job, None, str(tmp_path / "ws"), None)
  assert graphdef is not None and jax.tree.leaves(params)


def test_0p6b_matches_the_paper_setting():
  job = RLJob.from_config(_module("qwen3_0p6b_countdown.py").get_config("/ckpt/Qwen3-0.6B"))
  assert (job.task.name, job.warm_start.source, job.warm_start.path) == (
      "countdown", "hf", "/ckpt/Qwen3-0.6B")
  assert (job.rl.prompts_per_step, job.rl.group_size, job.rl.n_minibatches, job.sampler.max_new_tokens) == (
      64, 8, 1, 512)
  assert (job.loss.method, job.loss.score_centering, job.loss.topk, job.sampler.record_topk) == (
      "pg", "topk", 128, 128)
  assert (job.advantage.mode, job.advantage.reward_mode) == ("group_centered", "pm1")
  assert (job.optim.name, job.optim.lr, job.optim.schedule) == ("sgd", 1e-2, "constant")
  assert (job.sampler.temperature, job.sampler.dtype) == (1.0, "bfloat16")
  assert job.mesh.resolve(8) == (1, 8, 1, 1)


@pytest.mark.parametrize("n", qwen3_30b_a3b_minirl.N_CHOICES)
def test_30b_minirl_batches_and_replay(n):
  job = RLJob.from_config(qwen3_30b_a3b_minirl.get_config(f"n{n}"))
  assert job.rl.prompts_per_step // job.rl.n_minibatches * job.rl.group_size == 1024
  assert job.rl.n_minibatches == n
  assert job.rl.routing_replay == {1: "none", 2: "R2", 4: "R3", 8: "R3"}[n]
  assert (job.loss.method, job.loss.aggregation, job.loss.minirl_tis_c) == ("minirl", "constant", 5.0)
  assert (job.loss.minirl_eps_low, job.loss.minirl_eps_high) == (0.2, 0.27)
  assert job.model.remat and job.model.dtype == "bfloat16" and job.model.is_moe


def _layout(job, n_devices):
  """{param path: (shape, PartitionSpec)} from the one table of partition rules, on a fake mesh."""
  mesh = AbstractMesh(job.mesh.resolve(n_devices), sh.MESH_AXES)
  out = {}
  for path, var in _flat_vars(_abstract(job.model)):
    shape = tuple(var.get_value().shape)
    spec = sh.logical_to_spec(var.get_metadata().get("axes"), shape, mesh)
    # A size-1 mesh axis splits nothing: compare layouts without them.
    spec = P(*(a if a is not None and mesh.shape[a] > 1 else None for a in spec))
    out[path] = (shape, var.get_value().dtype, spec)
  return mesh, out


def _flat_vars(state):
  from flax import nnx  # pylint: disable=g-import-not-at-top
  return [("/".join(str(k) for k in path), var) for path, var in nnx.to_flat_state(state)]


def _per_device_bytes(mesh, layout) -> float:
  total = 0.0
  for shape, dtype, spec in layout.values():
    split = math.prod(mesh.shape[a] for a in spec if a is not None)  # one mesh axis per dim here
    total += math.prod(shape) * np.dtype(dtype).itemsize / split
  return total


def test_30b_mesh_shards_experts_over_the_expert_axis():
  job = RLJob.from_config(qwen3_30b_a3b_minirl.get_config("n4"))
  mesh, layout = _layout(job, 32)
  assert dict(mesh.shape) == {"data": 1, "fsdp": 4, "expert": 8, "tensor": 1}
  # Scanned layers: one group of 48 MoE layers, each expert weight stacked [48, 128, ...] with the
  # 'layers' axis replicated; unrolled: 48 separate [128, ...] weights.
  scan = job.model.scan_layers
  lead = (None,) if scan else ()
  experts = {p: v for p, v in layout.items() if p.rsplit("/", 1)[-1] in ("w_gate", "w_up", "w_down")
             and len(v[0]) == 3 + len(lead)}
  assert len(experts) == 3 * (1 if scan else 48)
  for p, (shape, _, spec) in experts.items():
    assert shape[:len(lead)] == ((48,) if scan else ()), (p, shape)
    assert shape[len(lead)] == 128 and spec[len(lead)] == "expert", (p, spec)
    # d_model (2048) is split over fsdp too: every expert stack is split 32 ways.
    want = P(*lead, "expert", None, "fsdp") if p.endswith("w_down") else P(*lead, "expert", "fsdp", None)
    assert spec == want, (p, spec)
  # No large parameter stays whole on every device.
  for p, (shape, _, spec) in layout.items():
    assert math.prod(shape) < 1e6 or any(a is not None for a in spec), (p, shape, spec)
  per_device = _per_device_bytes(mesh, layout)
  # fp32 master weights: ~122 GB in all, ~4 GB per device (+ the same for gradients).
  assert 3e9 < per_device < 6e9, per_device


def test_0p6b_mesh_is_fsdp_over_one_host():
  job = RLJob.from_config(_module("qwen3_0p6b_countdown.py").get_config())
  mesh, layout = _layout(job, 8)
  shape, _, spec = layout["embedding"]
  assert shape == (151936, 1024) and spec == P(None, "fsdp")
  assert _per_device_bytes(mesh, layout) < 0.6e9 * 4 / 8 * 1.05


# Sampler settings a generate rejects while it is traced (its waves, slots, prefill chunks), on the
# test config's 8 rows x 8 devices: (overrides, the key named). The job's mesh check raises the same
# error before any compute (RLJob.check_mesh -> SamplerConfig.check_rows), not after a warm start.
TRACE_TIME_CHECKS = [
    ({"sampler.max_rows_in_flight": 3}, "sampler.max_rows_in_flight"),      # 3 does not divide 8 rows
    ({"sampler.max_rows_in_flight": 4}, "sampler.max_rows_in_flight"),      # 4 rows over 8 devices
    ({"sampler.prefill_rows": 3}, "sampler.prefill_rows"),
    ({"sampler.engine": "continuous", "sampler.slots": 3}, "sampler.slots"),
    ({"sampler.engine": "continuous", "sampler.prefill_rows": 4}, "sampler.prefill_rows"),
    ({"rl.eval_rows_in_flight": 3}, "rl.eval_rows_in_flight"),
]


@pytest.fixture(scope="module")
def tiny_params_on_8():
  job = RLJob.from_config(countdown_tiny.get_config("test"))
  mesh = sh.make_mesh(job.mesh, jax.devices()[:8])
  return mesh, train_state.init_params(job.model, 0, mesh)[1]


@pytest.mark.parametrize("overrides,key", TRACE_TIME_CHECKS, ids=lambda x: str(x) if isinstance(x, str) else None)
def test_a_generate_that_would_fail_its_trace_fails_the_jobs_mesh_check(tiny_params_on_8, overrides, key):
  mesh, params = tiny_params_on_8
  job = RLJob.from_config(sweeps.apply_overrides(countdown_tiny.get_config("test"), overrides))  # passes alone
  with pytest.raises(ConfigError, match=f"config key '{re.escape(key)}'") as at_config:
    job.check_mesh(mesh)
  # The trace's own error (the evaluation's names the sampler's key, the one its config carries).
  rl, cfg, rows = job.rl, job.sampler, job.rl.prompts_per_step * job.rl.group_size
  if key.startswith("rl.eval"):
    cfg, rows = job.sampler.eval_configs(rl.eval_temperature, rl.eval_rows_in_flight)[0], rl.eval_size
  state = sampler_weights.sync_weights(params, None, None, cfg.dtype)
  prompts = np.ones((rows, cfg.max_prompt_len), np.int32)
  with pytest.raises(ConfigError) as at_trace:
    gen.generate(sampler_weights.sampler_graphdef(job.model, cfg.dtype), state, prompts, prompts > 0,
                 jax.random.key(0), cfg, mesh=mesh)
  same = str(at_config.value) if not key.startswith("rl.eval") else str(at_config.value).replace(key, "sampler.max_rows_in_flight")
  assert str(at_trace.value) == same
