"""Seed-batched programs: a vmapped seed's rollout, p_old and update equal the same seed run alone."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax import rollout as rollout_lib
from rl_jax.configs import countdown_tiny
from rl_jax.rl import seed_batch
from rl_jax.rl import trainer as trainer_lib

pytestmark = pytest.mark.usefixtures("fast_compile")

# Batched matmuls (a leading seed axis) block their reductions differently from the per-seed
# ones: the same row moves by ~1 ulp (measured <= 2e-6 on log-probs of ~5), like any change of
# batch shape on XLA:CPU (tests/test_sampler.py::test_waves_and_prefill_chunks_equal_one_batch).
ATOL = 2e-5


def _trainer(tmp_path, seed):
  cfg = countdown_tiny.get_config("test")
  cfg.seed = seed
  cfg.warm_start.source = "none"
  cfg.mesh.fsdp = 1
  cfg.mesh.num_devices = 1
  return trainer_lib.RLTrainer(cfg, str(tmp_path / f"seed{seed}"))


def test_a_vmapped_seed_equals_the_seed_alone(tmp_path):
  trs = [_trainer(tmp_path, s) for s in (0, 1)]
  try:
    progs = seed_batch.vmapped(trs[0].programs)
    prompts = [tr.prompts(0) for tr in trs]
    ids = [rollout_lib.repeat_prompts((i, v), tr.job.rl.group_size) for (_, i, v), tr in zip(prompts, trs)]
    keys = [jax.random.fold_in(jax.random.key(tr.job.seed), 0) for tr in trs]
    alone = [tr.programs.sampler.generate(tr.sampler_state, *iv, k) for tr, iv, k in zip(trs, ids, keys)]
    ro = progs["generate"](seed_batch.stack([tr.sampler_state for tr in trs]),
                           jnp.stack([jnp.asarray(i, jnp.int32) for i, _ in ids]),
                           jnp.stack([jnp.asarray(v, bool) for _, v in ids]), jnp.stack(keys))
    for s, (a, b) in enumerate(zip(alone, seed_batch.unstack(ro, 2))):
      np.testing.assert_array_equal(b.tokens_BS, a.tokens_BS, err_msg=f"seed {s}")
      np.testing.assert_allclose(b.logq_BT, a.logq_BT, atol=ATOL, err_msg=f"seed {s}")
    rewards = [np.linspace(0, 1, a.tokens_BS.shape[0]).astype(np.float32) for a in alone]
    batches = [tr.prepare(a, r)[0] for tr, a, r in zip(trs, alone, rewards)]
    params = seed_batch.stack([tr.state["params"] for tr in trs])
    opt = seed_batch.stack([tr.state["opt_state"] for tr in trs])
    new_params, _, m = progs["update"](params, opt, seed_batch.stack(batches))
    for s, (tr, b) in enumerate(zip(trs, batches)):
      p1, _, m1 = tr.programs.learner.update(tr.state["params"], tr.state["opt_state"], b)
      for x, y in zip(jax.tree.leaves(seed_batch.unstack(new_params, 2)[s]), jax.tree.leaves(p1)):
        np.testing.assert_allclose(x, y, atol=ATOL, err_msg=f"seed {s}")
      np.testing.assert_allclose(m["loss"][s], m1["loss"], rtol=1e-5, err_msg=f"seed {s}")
  finally:
    for tr in trs:
      tr.close()
