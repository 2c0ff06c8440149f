"""rl_jax.explore: exact drift / variance by enumeration against closed forms, mismatch and replay probes."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rl_jax import explore
from rl_jax import train_state
from rl_jax.models import ModelConfig
from rl_jax.rl import programs as programs_lib
from rl_jax.rl import step as step_lib
from rl_jax.rl.loss.loss_config import LossConfig
from rl_jax.sampler.config import SamplerConfig

pytestmark = pytest.mark.usefixtures("fast_compile")

V = 10
Z = jax.random.normal(jax.random.key(0), (V,)) * 2.0
D = jax.random.normal(jax.random.key(1), (V,))


def _cfg(**kw):
  return LossConfig(aggregation="constant", **kw)


def test_pg_drift_is_p_minus_q_and_on_policy_is_zero():
  """d(-log p_y)/dz = p - e_y, so E_q[g] = p - q: the drift of plain REINFORCE at A = 1."""
  logp, logq = explore.mismatched_pair(Z, D, 1.0)
  drift, var = explore.drift_and_variance(explore.per_token_logit_grads(logp, logq, _cfg()), logq)
  p, q = np.exp(logp), np.exp(logq)
  np.testing.assert_allclose(drift, p - q, atol=1e-6)
  # Var_q(e_y) = sum_y q_y ||e_y - q||^2 = 1 - ||q||^2.
  np.testing.assert_allclose(var, 1.0 - np.sum(q ** 2), rtol=1e-5)
  logp0, logq0 = explore.mismatched_pair(Z, D, 0.0)
  d0, _ = explore.drift_and_variance(explore.per_token_logit_grads(logp0, logq0, _cfg()), logq0)
  np.testing.assert_allclose(d0, 0.0, atol=1e-6)


@pytest.mark.parametrize("method", ["pg", "tis"])
def test_full_score_centering_removes_the_drift(method):
  logp, logq = explore.mismatched_pair(Z, D, 1.5)
  g = explore.per_token_logit_grads(logp, logq, _cfg(method=method, score_centering="full"))
  np.testing.assert_allclose(explore.drift_and_variance(g, logq)[0], 0.0, atol=1e-6)


def test_topk_centering_is_exact_iff_the_tail_is_proportional():
  k = 4
  # A direction that is constant outside q's head keeps q proportional to p on the tail.
  head = np.argsort(-np.asarray(Z))[:k]
  d_prop = np.zeros(V, np.float32)
  d_prop[head] = np.asarray(D)[head]
  cfg = _cfg(score_centering="topk", topk=k)
  logp, logq = explore.mismatched_pair(Z, d_prop, 0.5)
  assert set(np.argsort(-np.asarray(logq))[:k]) == set(head)
  np.testing.assert_allclose(explore.drift_and_variance(explore.per_token_logit_grads(logp, logq, cfg), logq)[0],
                             0.0, atol=1e-6)
  rec = explore.tail_reconstruction(logp, logq, k)
  np.testing.assert_allclose(rec["reconstructed_q"], rec["q"], atol=1e-6)
  # A generic direction: the residual drift is what the reconstruction misses on the tail.
  logp, logq = explore.mismatched_pair(Z, D, 1.0)
  drift = explore.drift_and_variance(explore.per_token_logit_grads(logp, logq, cfg), logq)[0]
  rec = explore.tail_reconstruction(logp, logq, k)
  assert np.linalg.norm(drift) > 1e-3
  np.testing.assert_allclose(rec["reconstructed_q"].sum(), 1.0, atol=1e-6)
  np.testing.assert_allclose(rec["reconstructed_q"][:k], rec["q"][:k])
  # E_q[g] = rho p - q off the head (by the derivation in score_centering_coeffs' docstring).
  resid = np.zeros(V, np.float32)
  tail_ids = rec["ids"][k:]
  resid[tail_ids] = (rec["reconstructed_q"] - rec["q"])[k:]
  np.testing.assert_allclose(drift, resid, atol=1e-6)


def test_naive_is_is_unbiased_with_closed_form_variance():
  logp, logq = explore.mismatched_pair(Z, D, 2.0)
  g = explore.per_token_logit_grads(logp, logq, _cfg(method="naive_is"))
  drift, var = explore.drift_and_variance(g, logq)
  p, q = np.exp(np.asarray(logp)), np.exp(np.asarray(logq))
  np.testing.assert_allclose(drift, 0.0, atol=1e-6)
  # g_y = (p_y / q_y)(p - e_y): sum_y q_y (p_y/q_y)^2 ||p - e_y||^2.
  norms = np.sum(p ** 2) - 2 * p + 1
  np.testing.assert_allclose(var, np.sum(p ** 2 / q * norms), rtol=1e-5)


def test_drift_sweep_shapes_and_needs_constant_aggregation():
  r = explore.drift_sweep(Z, D, [0.0, 1.0], {"pg": _cfg(), "sc": _cfg(score_centering="full")})
  assert r["pg"]["drift_norm"].shape == (2,) and r["pg"]["drift_norm"][1] > 0.05
  assert r["sc"]["drift_norm"][1] < 1e-5 and r["pg"]["tv"][0] == 0.0
  with pytest.raises(ValueError, match="aggregation"):
    explore.per_token_logit_grads(*explore.mismatched_pair(Z, D, 1.0), LossConfig())


def test_routing_agreement_per_layer_by_hand():
  trainer = jnp.array([[[[0, 1], [2, 3]]]])            # B=1, S=1, L=2, K=2
  sampler = jnp.array([[[[1, 0], [2, 0]]]])
  per_layer = explore.routing_agreement_per_layer(trainer, sampler, jnp.ones((1, 1), bool))
  np.testing.assert_allclose(per_layer, [1.0, 0.5])
  np.testing.assert_allclose(per_layer.mean(), step_lib.routing_agreement(trainer, sampler, jnp.ones((1, 1), bool)))


def _tiny():
  cfg = ModelConfig(vocab_size=16, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=32, d_ff=32,
                    n_experts=4, n_experts_per_tok=2, moe_d_ff=32, mlp_only_layers=(), dtype="float32",
                    param_dtype="float32")
  graphdef, params = train_state.init_params(cfg, seed=0)
  ids = jax.random.randint(jax.random.key(2), (4, 3), 3, 16)
  return cfg, graphdef, params, ids, jnp.ones((4, 3), bool)


def _regime_stats(presets, sigmas):
  cfg, graphdef, params, ids, valid = _tiny()
  base = SamplerConfig(max_prompt_len=3, max_new_tokens=4, record_topk=16, eos_id=1, pad_id=0)
  samplers = explore.regimes(presets, sigmas, base)
  return samplers, explore.mismatch_by_regime(cfg, graphdef, params, ids, valid, samplers, jax.random.key(3),
                                              head_k=4)


def test_fp32_regime_has_no_mismatch_and_unfit_presets_are_skipped():
  samplers, (stats, skipped) = _regime_stats(["none", "int4_w"], [])
  assert list(samplers) == ["none", "int4_w"]
  # int4_w's 128-wide groups do not divide this model's contraction dims (32): skipped, with the key.
  assert list(stats) == ["none"] and list(skipped) == ["int4_w"] and "block_size" in skipped["int4_w"]
  s = stats["none"]
  assert abs(s["kl_k1"]) < 1e-6 and abs(s["kl_exact"]) < 1e-6 and s["routing_agreement"] == 1.0
  np.testing.assert_allclose(s["head_mass_p"], s["head_mass_q"], atol=1e-6)


@pytest.mark.slow
def test_quantized_and_noisy_regimes_have_mismatch():
  samplers, (stats, skipped) = _regime_stats(["fp4_w"], [0.05])
  assert list(samplers) == ["fp4_w", "noise relative 0.05"] and not skipped
  for name, s in stats.items():
    assert s["kl_exact"] > 1e-6 and s["kl_k3"] > 0, name


@pytest.mark.slow  # ~17 s; the routing_replay notebook (slow) runs it too
def test_replay_trajectory_staleness_starts_at_zero():
  cfg, graphdef, params, ids, valid = _tiny()
  base = SamplerConfig(max_prompt_len=3, max_new_tokens=4, record_topk=0, eos_id=1, pad_id=0, quant="fp4_w")
  ro = explore.sample(cfg, params, ids, valid, jax.random.key(4), base)
  opt = optax.sgd(0.5)
  adv = jnp.array([1.0, -1.0, 1.0, -1.0])
  out = {r: explore.replay_trajectory(graphdef, params, opt.init(params), ro, adv, loss_cfg=LossConfig(),
                                      optimizer=opt, replay=r, n_minibatches=2) for r in ("none", "R3")}
  for r, o in out.items():
    assert o["stale_abs_max"][0] < 1e-5, r   # theta_0 = theta_old under the same routing
    assert o["stale_abs_mean"][1] > 0, r     # one update later the policy moved
    assert o["agreement_L"].shape == (2, 2)
  assert "mismatch/routing_agreement" in out["none"]["old_forward"]
  # The programs that ran are the factory's (cached per configuration: these are the jits explore
  # called), and the caller's params survived the update's donation.
  for r in out:
    progs = programs_lib.build_local(graphdef, LossConfig(), replay=r, optimizer=opt)
    assert progs.learner.old_forward._cache_size() == 1, r  # pylint: disable=protected-access
    assert progs.learner.probe._cache_size() >= 1 and progs.learner.update._cache_size() >= 1, r  # pylint: disable=protected-access
  assert not any(x.is_deleted() for x in jax.tree.leaves(params))
  # The first update sees identical inputs whatever the replay only when routing agrees: at
  # least its loss is finite and the same sign convention holds.
  assert all(np.isfinite(o["loss"]).all() for o in out.values())
