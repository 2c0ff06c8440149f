"""The loss methods' table: `MethodSpec`, `METHOD_REGISTRY` (name -> spec, in registration order: the
order every derived list uses), `method` / `add_method` / `register_method` (rl_jax/config_registry.py:
`Param` and the config machinery its entries' fields go through)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

from rl_jax.config_registry import Param, add_entry  # Param: re-exported, a method's `params=` entries

__all__ = ["METHOD_REGISTRY", "MethodSpec", "Param", "add_method", "method", "register_method"]


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


METHOD_REGISTRY: dict[str, MethodSpec] = {}


def method(name: str, rule: Callable, *, level: str, statistic: str, weight_fn=None,
           sc_incompatible: Optional[str] = None, needs_logp_old=None, params: Optional[dict] = None,
           check=None, p_old_incompatible: Optional[str] = None) -> MethodSpec:
  """The spec of loss method `name`: its rule `(TokenInputs, LossConfig) -> RuleOutput` and the
  fields above (MethodSpec); `add_method` or `register_method` puts it in the table."""
  return MethodSpec(name, rule, level, statistic, weight_fn, sc_incompatible,
                    needs_logp_old or (lambda cfg: False), dict(params or {}), check, p_old_incompatible)


def add_method(spec: MethodSpec) -> None:
  """Puts `spec` in METHOD_REGISTRY (after the ones there); a name or a config field taken twice raises."""
  add_entry(METHOD_REGISTRY, spec.name, spec)


def register_method(name: str, **kw):
  """Decorator registering a rule `(TokenInputs, LossConfig) -> RuleOutput` as loss method `name`
  (the keywords of `method`), for a method in a module of your own; the built-in ones are
  `methods.BUILTIN_METHODS`.

  Everything else (LossConfig's fields and validation of `loss.method`, the score-centering
  composability check, the sweep over methods, the test parametrizations) reads the table.
  """
  def deco(rule):
    add_method(method(name, rule, **kw))
    return rule
  return deco
