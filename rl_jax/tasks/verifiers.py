"""Verifiers chosen by `data_source`: a registry (math, countdown, exact_match) plus a user's `module:function`.

A verifier maps (completion, ground truth, extra info) to (reward in [0, 1], error), where error
is '' for a correct answer and a short name otherwise. `isolated` verifiers (the symbolic math
one, every user function) run in the bounded worker processes of rl_jax.tasks.sandbox; the
others are bounded by construction and run in the calling process.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import importlib
import math
from typing import Any, Callable, Sequence

from rl_jax.config_utils import ConfigError
from rl_jax.tasks import reward as reward_lib

# Completions are cut to their last this-many characters before verification: the final answer
# is at the end, and no verifier should scan a megabyte a model wrote.
TAIL_CHARS = 8192
# Error codes of the built-in verifiers (the sandbox adds timeout / memory / worker_crashed / ...).
NO_ANSWER, WRONG, BAD_TRUTH = "no_answer", "wrong_value", "bad_ground_truth"

VerifierFn = Callable[[str, Any, dict], "tuple[float, str]"]


@dataclasses.dataclass(frozen=True)
class Verifier:
  name: str
  fn: VerifierFn
  isolated: bool


_VERIFIERS: dict[str, Verifier] = {}


def register_verifier(name: str, isolated: bool = True):
  """Decorator registering `fn(completion, ground_truth, extra_info) -> (reward, error)` as `name`."""
  def deco(fn: VerifierFn) -> VerifierFn:
    if name in _VERIFIERS:
      raise ValueError(f"verifier {name!r} is already registered")
    _VERIFIERS[name] = Verifier(name, fn, isolated)
    return fn
  return deco


def list_verifiers() -> list[str]:
  return sorted(_VERIFIERS)


def is_user_spec(spec: str) -> bool:
  return ":" in spec


def check_spec(spec: str, key: str) -> None:
  """A registered name, or `module:function` naming an importable callable (checked now, not mid-run)."""
  if is_user_spec(spec):
    _user_function(spec, key)
  elif spec not in _VERIFIERS:
    raise ConfigError(f"config key '{key}': unknown verifier {spec!r}; valid: {list_verifiers()} "
                      "or a user function as 'module:function'")


def is_isolated(spec: str) -> bool:
  return is_user_spec(spec) or _VERIFIERS[spec].isolated


def _user_function(spec: str, key: str = "task.overrides.verifiers") -> Callable:
  module, _, name = spec.partition(":")
  try:
    fn = getattr(importlib.import_module(module), name)
  except (ImportError, AttributeError) as e:
    raise ConfigError(f"config key '{key}': cannot load verifier {spec!r} ({e})") from None
  if not callable(fn):
    raise ConfigError(f"config key '{key}': {spec!r} is not callable")
  return fn


def _clip(x: Any) -> float | None:
  try:
    v = float(x)
  except (TypeError, ValueError, OverflowError):
    return None
  return min(1.0, max(0.0, v)) if math.isfinite(v) else None


def call_local(spec: str, data_source: str, completion: str, ground_truth: Any,
               extra_info: dict) -> tuple[float, str]:
  """Runs one verifier here (the sandbox worker calls this). User functions take verl's signature
  `fn(data_source, solution_str, ground_truth, extra_info)` and return a number, a bool or a dict
  with 'score' (and optionally 'error')."""
  if not is_user_spec(spec):
    reward, error = _VERIFIERS[spec].fn(completion, ground_truth, extra_info)
    return float(reward), str(error)
  out = _user_function(spec)(data_source, completion, ground_truth, extra_info)
  error = ""
  if isinstance(out, dict):
    error, out = str(out.get("error", "")), out.get("score")
  reward = _clip(out)
  if reward is None:
    return 0.0, "bad_result"
  return reward, error or ("" if reward >= 1.0 else WRONG)


# --- choosing a verifier per data_source ------------------------------------------------------

def parse_map(spec: str, key: str) -> list[tuple[str, str]]:
  """'pat=verifier,pat2=verifier2' -> [(fnmatch pattern, verifier spec)], each spec checked."""
  out = []
  for part in [p.strip() for p in spec.split(",") if p.strip()]:
    pat, sep, ver = part.partition("=")
    if not sep or not pat.strip() or not ver.strip():
      raise ConfigError(f"config key '{key}': {part!r} is not source_pattern=verifier")
    check_spec(ver.strip(), key)
    out.append((pat.strip(), ver.strip()))
  return out


def choose(source: str, rules: Sequence[tuple[str, str]], default: str) -> str:
  """The first rule whose pattern matches `source` (fnmatch), else `default`."""
  for pat, ver in rules:
    if fnmatch.fnmatchcase(source, pat):
      return ver
  return default


# --- built-in verifiers -----------------------------------------------------------------------

def last_boxed(text: str) -> str | None:
  """Content of the last \\boxed{...} (or \\fbox{...}) with balanced braces, else None (linear scan)."""
  start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
  if start < 0:
    return None
  i = text.index("{", start) + 1
  depth = 1
  for j in range(i, len(text)):
    c = text[j]
    if c == "{":
      depth += 1
    elif c == "}":
      depth -= 1
      if depth == 0:
        return text[i:j]
  return None


def _norm(s: str) -> str:
  return " ".join(s.split()).strip().rstrip(".")


@register_verifier("exact_match", isolated=False)
def exact_match(completion: str, ground_truth: Any, extra_info: dict) -> tuple[float, str]:
  """1 iff the last \\boxed{} content (or, without one, the whole completion) equals the ground
  truth up to surrounding whitespace, runs of spaces and a final period."""
  del extra_info
  if not isinstance(completion, str):
    return 0.0, "not_text"
  got = last_boxed(completion)
  got = completion if got is None else got
  want = ground_truth if isinstance(ground_truth, str) else str(ground_truth)
  return (1.0, "") if _norm(got) == _norm(want) else (0.0, WRONG)


@register_verifier("countdown", isolated=False)
def countdown(completion: str, ground_truth: Any, extra_info: dict) -> tuple[float, str]:
  """The project's Countdown reward; ground truth {'target': int, 'numbers': [int, ...]} (TinyZero)."""
  del extra_info
  try:
    target, numbers = int(ground_truth["target"]), [int(x) for x in ground_truth["numbers"]]
  except (TypeError, KeyError, ValueError):
    return 0.0, BAD_TRUTH
  d = reward_lib.score_countdown(completion, numbers, target)
  return d.reward, d.error


def _math_gold(ground_truth: Any):
  from math_verify import parse  # pylint: disable=g-import-not-at-top
  text = ground_truth if isinstance(ground_truth, str) else str(ground_truth)
  if not text.strip():
    return []
  # A bare answer is read as the content of a \boxed{} (so `1/2`, `\frac12`, `\{1,2\}` all parse).
  gold = parse(text if "\\boxed" in text else f"\\boxed{{{text}}}", parsing_timeout=2)
  return gold or parse(text, parsing_timeout=2)


@register_verifier("math", isolated=True)
def math_answer(completion: str, ground_truth: Any, extra_info: dict) -> tuple[float, str]:
  """Symbolic / numeric equivalence of the completion's final answer and the ground truth
  (math-verify: the last \\boxed{}, a final 'answer is' line or the last expression)."""
  del extra_info
  from math_verify import parse, verify  # pylint: disable=g-import-not-at-top
  if not isinstance(completion, str):
    return 0.0, "not_text"
  gold = _math_gold(ground_truth)
  if not gold:
    return 0.0, BAD_TRUTH
  pred = parse(completion[-TAIL_CHARS:], parsing_timeout=2)
  if not pred:
    return 0.0, NO_ANSWER
  return (1.0, "") if verify(gold, pred, timeout_seconds=2) else (0.0, WRONG)
