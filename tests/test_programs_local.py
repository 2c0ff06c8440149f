"""programs.build_local: the notebooks' (rl_jax.explore) programs are the trainer's, from the one factory."""
import ast
import pathlib

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from rl_jax import sharding as sh
from rl_jax.configs import countdown_tiny
from rl_jax.models import families
from rl_jax.rl import programs as programs_lib
from rl_jax.rl import step as step_lib
from rl_jax.rl.job import RLJob
from rl_jax.study import sweeps

pytestmark = pytest.mark.usefixtures("fast_compile")

EXPLORE = pathlib.Path(__file__).resolve().parents[1] / "rl_jax" / "explore.py"


def _job(**overrides):
  cfg = countdown_tiny.get_config("test")
  cfg.warm_start.source = "none"
  cfg.mesh.num_devices = 1
  return RLJob.from_config(sweeps.apply_overrides(cfg, overrides))


def _sds(x, sharding=None):
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


# score_centering 'none' with a recorded top-k is where explore once built its own batch without
# the top-k (the trainer keeps it for the drift meter): the p_old forward then took other inputs.
@pytest.mark.parametrize("replay", ["none", "R3"])
def test_local_programs_lower_to_the_trainers(replay):
  """The p_old forward, sampler sync and rollout generate of `build_local` lower to the same HLO
  as `build`'s on the same one-device mesh, from the batch each side prepares."""
  job = _job(**{"rl.routing_replay": replay, "loss.score_centering": "none",
                "sampler.quant": "int8_wa_int8_kv"})
  mesh = sh.make_mesh(job.mesh)
  graphdef, state = nnx.split(families.abstract_model(job.model))
  shardings = sh.param_shardings(state, mesh)
  params = jax.tree.map(_sds, nnx.to_pure_dict(state), shardings)
  trainer = programs_lib.build(job, mesh, graphdef, shardings, None, None)
  local = programs_lib.build_local(graphdef, job.loss, model=job.model, sampler=job.sampler, replay=replay)
  assert local is programs_lib.build_local(graphdef, job.loss, model=job.model, sampler=job.sampler,
                                           replay=replay)  # cached: one compile per configuration

  b, p = job.rl.prompts_per_step * job.rl.group_size, job.sampler.max_prompt_len
  prompts, valid = jax.ShapeDtypeStruct((b, p), jnp.int32), jax.ShapeDtypeStruct((b, p), jnp.bool_)
  key = jax.eval_shape(lambda: jax.random.key(0))
  texts = {}
  for name, progs in (("trainer", trainer), ("local", local)):
    sampler_state = jax.eval_shape(progs.sampler.sync, params, None)
    ro = trainer.sampler.rollout_shapes(sampler_state, prompts, valid, key)
    adv = jax.ShapeDtypeStruct((b,), jnp.float32)
    # The trainer's own batch (RLTrainer.prepare) against the local programs' `train_batch`.
    make = ((lambda r, a: step_lib.TrainBatch.from_rollout(r, a, with_topk=True, truncated=job.loss.kept_set_mask))
            if name == "trainer" else progs.learner.train_batch)
    batch, ids, ids_valid = jax.eval_shape(lambda r, a: (make(r, a), r.expert_ids_BSLK, r.expert_valid_BS), ro, adv)
    assert batch.topk_ids_BTK is not None
    texts[name] = dict(
        old_forward=progs.learner.old_forward.lower(params, batch, ids, ids_valid).as_text(),
        sync=progs.sampler.lower_sync(params, None).as_text(),
        generate=progs.sampler.lower_generate(sampler_state, prompts, valid, key).as_text())
  for program, text in texts["trainer"].items():
    assert texts["local"][program] == text, program
  # The sync quantized the tagged weights: the two programs agree on something non-trivial.
  assert "i8" in texts["local"]["sync"]


def test_build_local_needs_what_each_program_reads():
  job = _job()
  graphdef, _ = nnx.split(families.abstract_model(job.model))
  with pytest.raises(ValueError, match="LossConfig"):
    programs_lib.build_local(graphdef)
  with pytest.raises(ValueError, match="ModelConfig"):
    programs_lib.build_local(sampler=job.sampler)
  progs = programs_lib.build_local(graphdef, job.loss)
  assert progs.learner.update is None and progs.sampler.graphdef is None and progs.learner.old_forward is not None


def test_explore_jits_nothing_of_its_own():
  """rl_jax.explore runs the factory's programs: no jax.jit, no sampler internals, no step function
  called outside a program of `programs.build_local`."""
  tree = ast.parse(EXPLORE.read_text())
  jits = [n.lineno for n in ast.walk(tree)
          if (isinstance(n, ast.Attribute) and n.attr in ("jit", "pmap")) or (isinstance(n, ast.Name) and n.id == "jit")]
  assert not jits, f"explore.py jits at lines {jits}"
  imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module for a in n.names}
  imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
  assert "rl_jax.sampler.generate" not in imported and "generate" not in imported
  calls = {(n.func.value.id, n.func.attr) for n in ast.walk(tree)
           if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name)}
  for fn in ("old_forward", "update", "first_order"):
    assert ("step_lib", fn) not in calls, fn
  assert ("sampler_weights", "sync_weights") not in calls
  assert ("programs_lib", "build_local") in calls
