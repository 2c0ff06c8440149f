"""Registry invariants: one owner per name and per config field, and the entry's own consistency."""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax.config_utils import ConfigError, from_dict
from rl_jax import config_registry
from rl_jax import config_schema
from rl_jax.rl.loss import methods
from rl_jax.rl.loss import registry
from rl_jax.rl.loss.loss_config import registered_methods
from rl_jax.rl.loss.losses import rl_loss
from rl_jax.rl import advantages
from rl_jax.rl.advantages import AdvantageConfig
from rl_jax.rl.loss.loss_config import METHODS, LossConfig


def test_names_register_once_and_fields_have_one_owner():
  with pytest.raises(ValueError, match="already registered"):
    registry.register_method("pg", level="token", statistic="none", weight_fn=abs)(lambda x, c: x)
  with pytest.raises(ValueError, match="declared by both"):
    config_registry.params_owned({"a": advantages.EstimatorSpec("a", abs, {"f": registry.Param(1)}),
                                  "b": advantages.EstimatorSpec("b", abs, {"f": registry.Param(1)})})
  with pytest.raises(ValueError, match="exactly one of weight_fn"):
    registry.MethodSpec("m", abs, "token", "ratio")
  with pytest.raises(ValueError, match="exactly one of weight_fn"):
    registry.MethodSpec("m", abs, "token", "ratio", weight_fn=abs, sc_incompatible="why")
  assert METHODS == tuple(spec.name for spec in methods.BUILTIN_METHODS)
  assert tuple(registry.METHOD_REGISTRY)[:len(METHODS)] == METHODS   # listed first, in that order
  assert all(registry.METHOD_REGISTRY[s.name] is s for s in methods.BUILTIN_METHODS)


def test_config_fields_and_errors_come_from_the_registry():
  fields = {k: d for k, (_, d) in LossConfig.registry_fields().items()}
  cfg = LossConfig()
  for spec in registry.METHOD_REGISTRY.values():
    for name, p in spec.params.items():
      assert fields[name] == p.default == getattr(cfg, name)
  with pytest.raises(ConfigError, match=r"loss\.method.*'nope'.*'pg'.*'minirl'"):
    from_dict(LossConfig, {"method": "nope"}, prefix="loss")
  with pytest.raises(ConfigError, match=r"loss\.tis_high.*must be > 0"):
    from_dict(LossConfig, {"tis_high": 0.0}, prefix="loss")
  with pytest.raises(ConfigError, match=r"advantage\.mode.*'group_centered'.*'raw'"):
    from_dict(AdvantageConfig, {"mode": "nope"}, prefix="advantage")
  with pytest.raises(ConfigError, match=r"advantage\.std_ddof.*0 or 1"):
    from_dict(AdvantageConfig, {"std_ddof": 2}, prefix="advantage")
  with pytest.raises(ConfigError, match=r"advantage\.reward_mode.*'01'.*'pm1'"):
    from_dict(AdvantageConfig, {"reward_mode": "+-1"}, prefix="advantage")
  assert from_dict(AdvantageConfig, {"mode": "grpo", "std_ddof": 1}, prefix="a").std_ddof == 1


@pytest.fixture
def user_method():
  """A method with a parameter, registered the way a user's module would, after LossConfig was
  imported and instantiated; unregistered afterwards so no other test sees it."""
  assert LossConfig().method == "pg"   # the class is imported and in use before the registration
  name = "user_capped_is"
  weight = lambda r, a, cfg: jnp.minimum(r, cfg.user_cap)

  @registry.register_method(name, level="token", statistic="ratio", weight_fn=weight,
                            params={"user_cap": registry.Param(1.5, lambda v: v > 0, "must be > 0")})
  def rule(x, cfg):
    r = jax.lax.stop_gradient(jnp.exp(x.logp_BT - x.logq_BT))
    return methods._sg_weight_rule(x, weight(r, x.adv_BT, cfg), clipped=r > cfg.user_cap)  # pylint: disable=protected-access
  yield name
  del registry.METHOD_REGISTRY[name]


def test_a_method_registered_after_loss_config_owns_its_fields(user_method):
  cfg = from_dict(LossConfig, {"method": user_method, "user_cap": 3}, prefix="loss")
  assert cfg.user_cap == 3.0 and isinstance(cfg.user_cap, float)        # typed by its default
  assert LossConfig(method=user_method).user_cap == 1.5 and LossConfig().user_cap == 1.5
  assert dataclasses.replace(cfg, score_centering="topk").user_cap == 3.0
  assert hash(cfg) == hash(LossConfig(method=user_method, user_cap=3.0))   # still a static jit argument
  with pytest.raises(ConfigError, match=r"loss\.user_cap.*must be > 0"):
    from_dict(LossConfig, {"method": user_method, "user_cap": 0.0}, prefix="loss")
  assert config_schema.defaults("rl")["loss.user_cap"] == 1.5   # overridable from the command line
  assert user_method in registered_methods() and user_method not in METHODS
  # The loss runs it: on-policy (q = p) its weight is min(1, cap) = 1, so it equals plain PG.
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(size=(2, 3, 7)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, 7, (2, 3)))
  mask = jnp.ones((2, 3), bool)
  adv = jnp.asarray([1.0, -0.5])
  logq = jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]
  grad = lambda c: jax.grad(lambda z: rl_loss(z, targets, mask, adv, logq, c)[0])(logits)
  np.testing.assert_allclose(grad(cfg), grad(LossConfig()), rtol=1e-6, atol=1e-7)


def test_builtin_method_fields_are_declared_fields_of_the_class():
  """Issue 40: the built-in methods' thresholds are generated into LossConfig when the class is
  created (visible to `dataclasses.fields`), not read from `registry_params`."""
  declared = {f.name: f for f in dataclasses.fields(LossConfig)}
  owned = {k: p for m in METHODS for k, p in registry.METHOD_REGISTRY[m].params.items()}
  assert owned and set(owned) <= set(declared)
  assert all(declared[k].default == p.default for k, p in owned.items())
  cfg = LossConfig(method="tis", tis_high=3.0)
  assert cfg.tis_high == 3.0 and cfg.registry_params == ()
  assert dataclasses.replace(cfg, tis_high=4.0).tis_high == 4.0
  with pytest.raises(ValueError, match="already declares"):
    config_registry.registry_fields_now(registry.METHOD_REGISTRY)(
        type("Clash", (), {"__annotations__": {"tis_high": float}}))


def test_sequence_corrections_fields_are_overridable_from_the_command_line():
  """Every threshold and switch is a scalar key of the RL schema (`--config.loss.KEY=V`), typed by
  its default, and +-inf is a valid threshold."""
  defaults = config_schema.defaults("rl")
  for key in ("seq_tis_c", "seq_mis_low", "seq_mis_high", "geo_mask_low", "geo_mask_high",
              "geo_mask_tis_c", "opsm_delta", "opsm_base", "decoupled_ppo_low", "decoupled_ppo_high",
              "decoupled_ppo_c", "is_ratio", "rejection", "rejection_reduce", "rejection_threshold",
              "weight_norm"):
    assert defaults[f"loss.{key}"] == getattr(LossConfig(), key), key
  c = from_dict(LossConfig, {"method": "opsm", "opsm_delta": math.inf, "opsm_base": "tis",
                             "rejection": "k3", "rejection_reduce": "max",
                             "rejection_threshold": -math.inf, "seq_tis_c": 4}, prefix="loss")
  assert (c.opsm_delta, c.opsm_base, c.rejection_threshold, c.seq_tis_c) == (
      math.inf, "tis", -math.inf, 4.0)
  assert c.needs_logp_old is False and LossConfig(is_ratio="p_old").needs_logp_old
  assert LossConfig(method="decoupled_ppo").needs_logp_old
