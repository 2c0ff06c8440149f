"""Registries whose entries own config fields: `Param`, the class decorators that grow a config
dataclass by its registry's fields, and their checks (the loss methods' and the advantage estimators')."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

from rl_jax.config_utils import require


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


def params_owned(registry: dict) -> dict[str, tuple[str, Param]]:
  out = {}
  for owner, spec in registry.items():
    for field, p in spec.params.items():
      if field in out:
        raise ValueError(f"config field {field!r} is declared by both {out[field][0]!r} and "
                         f"{owner!r}; a field has one owner (make it a common field instead)")
      out[field] = (owner, p)
  return out


def add_entry(registry: dict, name: str, spec) -> None:
  if name in registry:
    raise ValueError(f"{name!r} is already registered")
  registry[name] = spec
  params_owned(registry)   # rejects a field declared twice


REGISTRY_FIELD = "registry_params"


GENERATED = "__registry_generated__"   # class attribute: the names `registry_fields_now` made fields


def registry_fields_now(registry: dict):
  """Class decorator (apply BELOW @dataclass, so it runs first): every Param the registry holds
  when the class is created becomes a declared, annotated field with its default, so the class
  shows it (`dataclasses.fields`, help(), an IDE). Entries registered after the class was created
  are `add_registry_params`' (stored in `registry_params`)."""
  def deco(cls):
    notes = cls.__dict__.get("__annotations__", {})
    clash = sorted(k for k in params_owned(registry) if k in notes)
    if clash:
      raise ValueError(f"{cls.__name__} already declares registry-owned field(s) {clash}")
    generated = []
    for k, (_, p) in params_owned(registry).items():
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
      owned = params_owned(registry)
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
      return {k: (type(p.default), p.default) for k, (_, p) in params_owned(registry).items()}

    cls.__init__ = __init__
    cls.__getattr__ = __getattr__
    cls.registry_fields = staticmethod(registry_fields)
    return cls
  return deco


def check_registry_params(cfg, registry: dict, selected: str, section: str) -> None:
  """Runs every registered Param check and cross-field check on `cfg` (a __post_init__ helper)."""
  for field, (owner, p) in params_owned(registry).items():
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
