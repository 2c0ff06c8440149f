"""Registry tables of loss methods and advantage estimators: the one place every list is derived from."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

from rl_jax.config_utils import require

# This module imports nothing from rl_jax.rl, so both the config dataclasses (which validate
# names against the tables and take their method-specific fields from them) and the modules
# that fill the tables (methods.py, advantages.py) can import it without a cycle.


@dataclasses.dataclass(frozen=True)
class Param:
  """A config field owned by one registry entry (a threshold of one method, say).

  default: its value when the config does not set it; its Python type is the field's type.
  check: value -> bool, or None; `why` is the error text when it returns False.
  owner_only: a non-default value is only valid when the owner is the configured entry
    (ablation switches such as MiniRL's), else it is validated but allowed (a threshold
    set for a method that is not selected does nothing).
  """
  default: Any
  check: Optional[Callable[[Any], bool]] = None
  why: str = ""
  owner_only: bool = False


@dataclasses.dataclass(frozen=True)
class MethodSpec:
  """One loss method.

  rule: (TokenInputs, LossConfig) -> RuleOutput (methods.py).
  level: 'token' or 'sequence' (the level of the statistic, Table 1 of [SC]).
  statistic: 'none', 'ratio' (p/q), 'tv' (|p - q|) or 'ratio+staleness' (MiniRL).
  weight_fn: f(r, A, cfg), the per-token ratio weight score centering composes with
    ([SC], Eq. 10; docs/math.md#composing-with-an-is-weight), or None: then `sc_incompatible`
    says why centering cannot compose.
  needs_logp_old: cfg -> whether the rule reads p_old (the forward at theta_old).
  p_old_incompatible: why the method has no decoupled form (`loss.is_ratio='p_old'`:
    docs/math.md#the-decoupled-ratio), or None when it has one.
  params: the config fields this method owns (name -> Param); LossConfig grows them.
  check: cfg -> None, raising ConfigError, for cross-field checks of those params (run on
    every config, as the defaults must stay valid whichever method is selected).
  """
  name: str
  rule: Callable
  level: str
  statistic: str
  weight_fn: Optional[Callable] = None
  sc_incompatible: Optional[str] = None
  needs_logp_old: Callable[[Any], bool] = lambda cfg: False
  params: dict = dataclasses.field(default_factory=dict)
  check: Optional[Callable[[Any], None]] = None
  p_old_incompatible: Optional[str] = None

  def __post_init__(self):
    if self.level not in ("token", "sequence"):
      raise ValueError(f"method {self.name!r}: level must be 'token' or 'sequence', got {self.level!r}")
    if (self.weight_fn is None) == (self.sc_incompatible is None):
      raise ValueError(f"method {self.name!r}: give exactly one of weight_fn (score centering "
                       "composes with it) and sc_incompatible (why it cannot)")


@dataclasses.dataclass(frozen=True)
class EstimatorSpec:
  """One advantage estimator: fn(rewards_NG, cfg) -> adv_NG on [groups, group size] rewards."""
  name: str
  fn: Callable
  params: dict = dataclasses.field(default_factory=dict)
  check: Optional[Callable[[Any], None]] = None   # cfg -> None, raising ConfigError


# name -> spec, in registration order (the order every derived list uses).
METHOD_REGISTRY: dict[str, MethodSpec] = {}
ADVANTAGE_REGISTRY: dict[str, EstimatorSpec] = {}
REWARD_MODE_REGISTRY: dict[str, Callable] = {}   # name -> rewards_B -> rewards_B


def _params_owned(registry: dict) -> dict[str, tuple[str, Param]]:
  out = {}
  for owner, spec in registry.items():
    for field, p in spec.params.items():
      if field in out:
        raise ValueError(f"config field {field!r} is declared by both {out[field][0]!r} and "
                         f"{owner!r}; a field has one owner (make it a common field instead)")
      out[field] = (owner, p)
  return out


def _add(registry: dict, name: str, spec) -> None:
  if name in registry:
    raise ValueError(f"{name!r} is already registered")
  registry[name] = spec
  _params_owned(registry)   # rejects a field declared twice


def register_method(name: str, *, level: str, statistic: str, weight_fn=None,
                    sc_incompatible: Optional[str] = None, needs_logp_old=None,
                    params: Optional[dict] = None, check=None,
                    p_old_incompatible: Optional[str] = None):
  """Decorator registering a rule `(TokenInputs, LossConfig) -> RuleOutput` as loss method `name`.

  Everything else (LossConfig's fields and validation of `loss.method`, the score-centering
  composability check, the sweep over methods, the test parametrizations) reads the table.
  """
  def deco(rule):
    _add(METHOD_REGISTRY, name, MethodSpec(
        name, rule, level, statistic, weight_fn, sc_incompatible,
        needs_logp_old or (lambda cfg: False), dict(params or {}), check, p_old_incompatible))
    return rule
  return deco


def register_advantage(name: str, *, params: Optional[dict] = None, check=None):
  """Decorator registering `fn(rewards_NG, cfg) -> adv_NG` as advantage estimator `name`."""
  def deco(fn):
    _add(ADVANTAGE_REGISTRY, name, EstimatorSpec(name, fn, dict(params or {}), check))
    return fn
  return deco


def register_reward_mode(name: str):
  """Decorator registering `fn(rewards_B) -> rewards_B` (task rewards in [0, 1]) as reward mode `name`."""
  def deco(fn):
    if name in REWARD_MODE_REGISTRY:
      raise ValueError(f"reward mode {name!r} is already registered")
    REWARD_MODE_REGISTRY[name] = fn
    return fn
  return deco


REGISTRY_FIELD = "registry_params"


GENERATED = "__registry_generated__"   # class attribute: the names `registry_fields_now` made fields


def registry_fields_now(registry: dict):
  """Class decorator (apply BELOW @dataclass, so it runs first): every Param the registry holds
  when the class is created becomes a declared, annotated field with its default, so the class
  shows it (`dataclasses.fields`, help(), an IDE). Entries registered after the class was created
  are `add_registry_params`' (stored in `registry_params`)."""
  def deco(cls):
    notes = cls.__dict__.get("__annotations__", {})
    clash = sorted(k for k in _params_owned(registry) if k in notes)
    if clash:
      raise ValueError(f"{cls.__name__} already declares registry-owned field(s) {clash}")
    generated = []
    for k, (_, p) in _params_owned(registry).items():
      notes[k] = type(p.default)
      setattr(cls, k, p.default)
      generated.append(k)
    cls.__annotations__ = notes
    setattr(cls, GENERATED, frozenset(generated))
    return cls
  return deco


def add_registry_params(registry: dict):
  """Class decorator (apply ABOVE @dataclass, whose class declares `registry_params: tuple = ()`):
  every registered entry's Params become keyword arguments and attributes of the config.

  They are read from the registry when a config is **built**, not when the class is: an entry
  registered later (a method with parameters in a user's module, after this class was imported)
  owns fields of every config built after it. The fields keep their names (`loss.tis_high`, ...),
  are stored as `registry_params` (name -> value pairs, in registration order, so the config
  stays frozen, hashable and comparable) and read as attributes; `registry_fields()` gives their
  types for `config_utils.from_dict` and the config schema. `dataclasses.replace` keeps them.
  """
  def deco(cls):
    own = {f.name for f in dataclasses.fields(cls)}
    generated = getattr(cls, GENERATED, frozenset())   # registry fields declared at class creation
    if REGISTRY_FIELD not in own:
      raise TypeError(f"{cls.__name__} must declare `{REGISTRY_FIELD}: tuple = ()` for add_registry_params")
    base_init = cls.__init__

    def __init__(self, *args, **kwargs):
      owned = _params_owned(registry)
      given = dict(kwargs.pop(REGISTRY_FIELD, ()))
      for k in [k for k in kwargs if k not in own]:
        if k not in owned:
          raise TypeError(f"{cls.__name__}() got an unexpected keyword argument {k!r}")
        given[k] = kwargs.pop(k)
      for k in owned.keys() & (own - generated):
        raise ValueError(f"{owned[k][0]!r} declares field {k!r}, which {cls.__name__} already has")
      values = tuple((k, given.get(k, p.default)) for k, (_, p) in owned.items() if k not in generated)
      base_init(self, *args, **{REGISTRY_FIELD: values}, **kwargs)

    def __getattr__(self, name):  # only reached when `name` is not an ordinary attribute
      for k, v in self.__dict__.get(REGISTRY_FIELD, ()):
        if k == name:
          return v
      raise AttributeError(f"{cls.__name__!r} object has no attribute {name!r}")

    def registry_fields(_cls=cls) -> dict[str, tuple[type, Any]]:
      """Entry-owned field -> (type, default), from the registry as it is now."""
      return {k: (type(p.default), p.default) for k, (_, p) in _params_owned(registry).items()}

    cls.__init__ = __init__
    cls.__getattr__ = __getattr__
    cls.registry_fields = staticmethod(registry_fields)
    return cls
  return deco


def check_registry_params(cfg, registry: dict, selected: str, section: str) -> None:
  """Runs every registered Param check and cross-field check on `cfg` (a __post_init__ helper)."""
  for field, (owner, p) in _params_owned(registry).items():
    value = getattr(cfg, field)
    if p.check is not None:
      require(p.check(value), field, f"{p.why}, got {value}")
    if p.owner_only and owner != selected:
      require(value == p.default, field,
              f"only applies to {section}={owner!r}, got {section}={selected!r}")
  for spec in registry.values():
    if spec.check is not None:
      spec.check(cfg)


def require_registered(name: str, registry: dict, key: str) -> None:
  """ConfigError naming `key` and the registered names unless `name` is one of them."""
  require(name in registry, key, f"{name!r} is not one of {list(registry)}")
