"""Turns ml_collections config sections into frozen, validated dataclasses at the boundary."""
from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal, Mapping, get_args, get_origin, get_type_hints


class ConfigError(ValueError):
  """A config key, value or combination is wrong; the message names the key."""


def _to_plain(section: Any) -> dict:
  if section is None:
    return {}
  if hasattr(section, "to_dict"):
    return section.to_dict()
  if isinstance(section, Mapping):
    return dict(section)
  if dataclasses.is_dataclass(section):
    d = dataclasses.asdict(section)
    d.update(dict(d.pop("registry_params", ())))   # registry-owned fields as the keys they are
    return d
  raise ConfigError(f"expected a config section (mapping), got {type(section).__name__}")


def _coerce(value: Any, hint: Any, key: str) -> Any:
  """Checks `value` against a type hint; Literal enums must match one of their values."""
  origin = get_origin(hint)
  if hint is Any:
    return value
  if origin is Literal:
    choices = get_args(hint)
    if value not in choices:
      raise ConfigError(f"config key '{key}': {value!r} is not one of {list(choices)}")
    return value
  if origin is typing.Union or (origin is not None and str(origin) == "<class 'types.UnionType'>"):
    args = get_args(hint)
    if value is None and type(None) in args:
      return None
    errors = []
    for a in args:
      if a is type(None):
        continue
      try:
        return _coerce(value, a, key)
      except ConfigError as e:
        errors.append(str(e))
    raise ConfigError(f"config key '{key}': {value!r} does not match {hint}: {'; '.join(errors)}")
  if origin in (tuple, list):
    if not isinstance(value, (tuple, list)):
      raise ConfigError(f"config key '{key}': expected a sequence, got {value!r}")
    args = get_args(hint)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
      return tuple(_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
    if origin is tuple and args:
      if len(args) != len(value):
        raise ConfigError(f"config key '{key}': expected {len(args)} items, got {len(value)}")
      return tuple(_coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    return tuple(value)
  if dataclasses.is_dataclass(hint):
    return from_dict(hint, value, prefix=key)
  if hint is bool:
    if not isinstance(value, bool):
      raise ConfigError(f"config key '{key}': expected a bool, got {value!r}")
    return value
  if hint is int:
    if isinstance(value, bool) or not isinstance(value, int):
      raise ConfigError(f"config key '{key}': expected an int, got {value!r}")
    return value
  if hint is float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise ConfigError(f"config key '{key}': expected a float, got {value!r}")
    return float(value)
  if hint is str:
    if not isinstance(value, str):
      raise ConfigError(f"config key '{key}': expected a string, got {value!r}")
    return value
  return value


def from_dict(cls: type, section: Any, prefix: str = "") -> Any:
  """Builds frozen dataclass `cls` from a mapping / ConfigDict.

  Unknown keys and wrong enum values raise ConfigError naming the full key
  (`prefix.key`); missing keys take the dataclass default. The dataclass's own
  `__post_init__` checks combinations and should raise ConfigError too.
  """
  if isinstance(section, cls):
    return section
  values = _to_plain(section)
  hints = get_type_hints(cls)
  fields = {f.name: f for f in dataclasses.fields(cls)}
  # Fields a registry entry owns (`config_registry.add_registry_params`), as the registry is now.
  extra = getattr(cls, "registry_fields", lambda: {})()
  hints.update({k: t for k, (t, _) in extra.items()})
  fields.update(extra)
  fields.pop("registry_params", None)   # the storage of those, not a config key
  name = lambda k: f"{prefix}.{k}" if prefix else k
  unknown = sorted(set(values) - set(fields))
  if unknown:
    raise ConfigError(
        f"unknown config key(s) {[name(k) for k in unknown]}; "
        f"valid keys of {cls.__name__}: {sorted(fields)}")
  kwargs = {k: _coerce(v, hints[k], name(k)) for k, v in values.items()}
  try:
    return cls(**kwargs)
  except ConfigError as e:
    msg = str(e)
    if not prefix:
      raise
    # Checks inside a dataclass may name a key relative to their section: make it absolute.
    head = "config key '"
    if msg.startswith(head):
      key = msg[len(head):].split("'", 1)[0]
      if not key.startswith(prefix + ".") and "." not in key.split("[")[0]:
        raise ConfigError(f"{head}{prefix}.{msg[len(head):]}") from None
      raise
    raise ConfigError(f"[{prefix}] {msg}") from None


def require(cond: bool, key: str, msg: str) -> None:
  """Raises ConfigError naming `key` unless `cond` holds (for __post_init__ checks)."""
  if not cond:
    raise ConfigError(f"config key '{key}': {msg}")


# Values a `--config.a.b=v` flag can set (ml_collections overrides a key only with its type).
SCALAR = (bool, int, float, str)


def scalar_defaults(cls: type) -> dict[str, Any]:
  """Field -> default of every scalar field of the config dataclass `cls` (and of the fields its
  registry entries own, `cls.registry_fields()`, as registered now)."""
  hints = get_type_hints(cls)
  out = {}
  for f in dataclasses.fields(cls):
    if f.default is not dataclasses.MISSING and isinstance(f.default, SCALAR):
      # A float field written with an int default (`tis_high: float = 2`) must take float flags.
      out[f.name] = float(f.default) if hints.get(f.name) is float else f.default
  for k, (t, default) in getattr(cls, "registry_fields", lambda: {})().items():
    if isinstance(default, SCALAR):
      out[k] = float(default) if t is float else default
  return out


def flat_defaults(sections: Mapping[str, type]) -> dict[str, Any]:
  """Flattened `section.key` -> default of every scalar field of a job's `sections` (name -> class)."""
  return {f"{name}.{k}": v for name, cls in sections.items() for k, v in scalar_defaults(cls).items()}
