"""Registry invariants: one owner per name and per config field, and the entry's own consistency."""
import dataclasses

import pytest

from rl_jax.config_utils import ConfigError, from_dict
from rl_jax.rl import registry
from rl_jax.rl.advantages import AdvantageConfig
from rl_jax.rl.loss_config import METHODS, LossConfig


def test_names_register_once_and_fields_have_one_owner():
  with pytest.raises(ValueError, match="already registered"):
    registry.register_method("pg", level="token", statistic="none", weight_fn=abs)(lambda x, c: x)
  with pytest.raises(ValueError, match="declared by both"):
    registry._params_owned({"a": registry.EstimatorSpec("a", abs, {"f": registry.Param(1)}),
                            "b": registry.EstimatorSpec("b", abs, {"f": registry.Param(1)})})
  with pytest.raises(ValueError, match="exactly one of weight_fn"):
    registry.MethodSpec("m", abs, "token", "ratio")
  with pytest.raises(ValueError, match="exactly one of weight_fn"):
    registry.MethodSpec("m", abs, "token", "ratio", weight_fn=abs, sc_incompatible="why")
  assert set(METHODS) == set(registry.METHOD_REGISTRY)


def test_config_fields_and_errors_come_from_the_registry():
  fields = {f.name: f.default for f in dataclasses.fields(LossConfig)}
  for spec in registry.METHOD_REGISTRY.values():
    for name, p in spec.params.items():
      assert fields[name] == p.default
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
