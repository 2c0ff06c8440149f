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
import re
from typing import Any, Callable, Sequence

from rl_jax.config_utils import ConfigError
from rl_jax.tasks import reward as reward_lib

# Completions are cut to their last this-many characters before verification: the final answer
# is at the end, and no verifier should scan a megabyte a model wrote.
TAIL_CHARS = 8192
# Error codes of the built-in verifiers (the sandbox adds timeout / memory / worker_crashed / ...).
NO_ANSWER, WRONG, BAD_TRUTH = "no_answer", "wrong_value", "bad_ground_truth"
# Which \boxed{} answers of a completion the built-in verifiers grade (task.overrides.boxed):
# 'last' (verl's rule: a model may correct itself), 'any' (one box equal suffices), 'all' (every box).
BOX_POLICIES = ("last", "any", "all")
# 'any' / 'all' read at most this many boxes (the last ones): a bound on the work per call.
MAX_BOXES = 16

VerifierFn = Callable[[str, Any, dict], "tuple[float, str]"]


@dataclasses.dataclass(frozen=True)
class Verifier:
  name: str
  fn: VerifierFn
  isolated: bool
  boxes: bool   # grades \boxed{} answers: called with `boxed=<policy>`


_VERIFIERS: dict[str, Verifier] = {}


def register_verifier(name: str, isolated: bool = True, boxes: bool = False):
  """Decorator registering `fn(completion, ground_truth, extra_info) -> (reward, error)` as `name`
  (with `boxes`, `fn(..., boxed=policy)`: one of BOX_POLICIES)."""
  def deco(fn: VerifierFn) -> VerifierFn:
    if name in _VERIFIERS:
      raise ValueError(f"verifier {name!r} is already registered")
    _VERIFIERS[name] = Verifier(name, fn, isolated, boxes)
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
  except (Exception, SystemExit) as e:  # pylint: disable=broad-except
    # The user's module runs on import: a SyntaxError, a NameError or a sys.exit there is a
    # config mistake too, reported in one line.
    raise ConfigError(f"config key '{key}': cannot load verifier {spec!r} "
                      f"({type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''})"
                      ) from None
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
               extra_info: dict, boxed: str = "last") -> tuple[float, str]:
  """Runs one verifier here (the sandbox worker calls this). User functions take verl's signature
  `fn(data_source, solution_str, ground_truth, extra_info)` and return a number, a bool or a dict
  with 'score' (and optionally 'error'); `boxed` reaches the built-in verifiers that grade boxes."""
  if not is_user_spec(spec):
    v = _VERIFIERS[spec]
    reward, error = v.fn(completion, ground_truth, extra_info, boxed=boxed) if v.boxes else \
        v.fn(completion, ground_truth, extra_info)
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


# verl's scorer of each data_source it names (its default_compute_score), consulted after
# task.overrides.verifiers and before default_verifier when task.overrides.verl_scorers is on.
VERL_SOURCES = (("openai/gsm8k", "gsm8k"), ("lighteval/MATH", "math"), ("DigitalLearningGmbH/MATH-lighteval", "math"),
                ("HuggingFaceH4/MATH-500", "math"), ("math_dapo", "dapo_math"), ("math", "dapo_math"),
                ("math_dapo_reasoning", "dapo_math"), ("aime*", "dapo_math"))


def choose(source: str, rules: Sequence[tuple[str, str]], default: str) -> str:
  """The first rule whose pattern matches `source` (fnmatch), else `default`."""
  for pat, ver in rules:
    if fnmatch.fnmatchcase(source, pat):
      return ver
  return default


def reference_answer(spec: str, answer: str) -> str:
  """A completion that states `answer` the way verifier `spec` reads it (the SFT target of a row
  without a solution, and what `preview` checks): '#### x' for gsm8k, 'Answer: x' for dapo_math,
  else a \\boxed{}."""
  if spec == "gsm8k":
    return f"The answer is\n#### {answer}"
  if spec == "dapo_math":
    return f"Answer: {answer}"
  return f"The answer is \\boxed{{{answer}}}."


# --- built-in verifiers -----------------------------------------------------------------------

def boxed_answers(text: str, limit: int = MAX_BOXES) -> list[str | None]:
  """Contents of the \\boxed{...} / \\fbox{...} groups of `text`, last first, at most `limit`; an
  unclosed group is None. Each group is one linear scan of the text after it (bounded input)."""
  out: list[str | None] = []
  end = len(text)
  while len(out) < limit:
    start = max(text.rfind("\\boxed{", 0, end), text.rfind("\\fbox{", 0, end))
    if start < 0:
      break
    i = text.index("{", start) + 1
    depth, found = 1, None
    for j in range(i, len(text)):
      c = text[j]
      if c == "{":
        depth += 1
      elif c == "}":
        depth -= 1
        if depth == 0:
          found = text[i:j]
          break
    out.append(found)
    end = start
  return out


def last_boxed(text: str) -> str | None:
  """Content of the last \\boxed{...} (or \\fbox{...}) with balanced braces, else None (linear scan)."""
  boxes = boxed_answers(text, 1)
  return boxes[0] if boxes else None


def _graded_boxes(text: str, boxed: str) -> list[str | None] | None:
  """The boxes `boxed` grades (None: the text has no box at all): the last one, or every one read."""
  boxes = boxed_answers(text, 1 if boxed == "last" else MAX_BOXES)
  return boxes or None


def _by_policy(results: list[bool], boxed: str) -> bool:
  return all(results) if boxed == "all" else any(results)


def _norm(s: str) -> str:
  return " ".join(s.split()).strip().rstrip(".")


@register_verifier("exact_match", isolated=False, boxes=True)
def exact_match(completion: str, ground_truth: Any, extra_info: dict, boxed: str = "last") -> tuple[float, str]:
  """1 iff the graded \\boxed{} content (`boxed`: the last, any or all of them; without a box, the
  whole completion) equals the ground truth up to surrounding whitespace, runs of spaces and a
  final period."""
  del extra_info
  if not isinstance(completion, str):
    return 0.0, "not_text"
  want = _norm(ground_truth if isinstance(ground_truth, str) else str(ground_truth))
  boxes = _graded_boxes(completion, boxed)
  got = [completion] if boxes is None else boxes
  ok = _by_policy([g is not None and _norm(g) == want for g in got], boxed)
  return (1.0, "") if ok else (0.0, WRONG)


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


# GSM8K's and DAPO's scorers read only the end of a completion, as verl does: the answer line is last.
VERL_TAIL_CHARS = 300
_GSM8K_ANSWER = re.compile(r"#### (-?[0-9.,]+)")
_DAPO_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")


def _gsm8k_number(text: str) -> str:
  return text.replace(",", "").replace("$", "")


@register_verifier("gsm8k", isolated=False)
def gsm8k(completion: str, ground_truth: Any, extra_info: dict) -> tuple[float, str]:
  """GSM8K's rule (verl's `gsm8k` scorer): the number after the last '#### ' in the completion's
  last 300 characters equals the ground truth (its '#### ' part, if it is a whole solution) as a
  string, commas and '$' removed."""
  del extra_info
  if not isinstance(completion, str):
    return 0.0, "not_text"
  want = str(ground_truth).rsplit("####", 1)[-1].strip()
  found = _GSM8K_ANSWER.findall(completion[-VERL_TAIL_CHARS:])
  if not found:
    return 0.0, NO_ANSWER
  return (1.0, "") if _gsm8k_number(found[-1]) == _gsm8k_number(want) else (0.0, WRONG)


# Minerva's answer normalization (Lewkowycz et al., 2022), the one DAPO's scorer compares with:
# spellings to rewrite, then units and filler to drop.
_MINERVA_REWRITE = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
                    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"))
_MINERVA_DROP = ("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
                 "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
                 "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
                 "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}",
                 "\\;", ",\\!", "{,}", '"', "\\dots")


def minerva_normalize(answer: str) -> str:
  """A final answer in Minerva's canonical form: the part after the last '=', units and spaces
  dropped, the contents of $...$, \\text{}, \\textbf{}, \\overline{}, \\boxed{}, shorthand
  \\fracab / \\sqrta spelled out, thousands separators removed from an integer."""
  answer = answer.split("=")[-1]
  for old, new in _MINERVA_REWRITE:
    answer = answer.replace(old, new)
  for word in _MINERVA_DROP:
    answer = answer.replace(word, "")
  answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", r"$\3$", answer)
  for macro in ("text", "textbf", "overline"):
    answer = re.sub(r"(\\" + macro + r"\{)(.*?)(\})", r"\2", answer)
  answer = re.sub(r"(\\boxed\{)(.*)(\})", r"\2", answer)
  answer = re.sub(r"(frac)([^{])(.)", r"frac{\2}{\3}", answer)
  answer = re.sub(r"(sqrt)([^{])", r"sqrt{\2}", answer)
  answer = answer.replace("$", "")
  if answer.replace(",", "").isdigit():
    answer = answer.replace(",", "")
  return answer.strip()


@register_verifier("dapo_math", isolated=False)
def dapo_math(completion: str, ground_truth: Any, extra_info: dict) -> tuple[float, str]:
  """DAPO's rule (verl's `math_dapo` scorer): the last 'Answer: ...' line of the completion's last
  300 characters equals the ground truth once both are in Minerva's normal form (verl scores a
  miss -1; here 0, and advantage.reward_mode='pm1' maps {0, 1} to {-1, +1})."""
  del extra_info
  if not isinstance(completion, str):
    return 0.0, "not_text"
  found = _DAPO_ANSWER.findall(completion[-VERL_TAIL_CHARS:])
  if not found:
    return 0.0, NO_ANSWER
  ok = minerva_normalize(found[-1]) == minerva_normalize(str(ground_truth))
  return (1.0, "") if ok else (0.0, WRONG)


def reads_answers(spec: str) -> bool:
  """Whether `answer_key` reads the answers of verifier `spec`."""
  return spec in ("math", "exact_match", "gsm8k", "dapo_math")


def answer_key(spec: str, completion: str) -> str | None:
  """The answer a completion states, as text, for a majority vote over samples (maj@k): the graded
  \\boxed{} (math, exact_match), GSM8K's '#### ' number, DAPO's normalized 'Answer:' line; None
  without one, or for a verifier whose answer is not text read here (countdown, a user function).
  Equal answers written differently ('0.5', '1/2') vote apart: the vote is on the text."""
  if not isinstance(completion, str):
    return None
  if spec in ("math", "exact_match"):
    box = last_boxed(completion[-TAIL_CHARS:])
    return None if box is None else _norm(box)
  if spec == "gsm8k":
    found = _GSM8K_ANSWER.findall(completion[-VERL_TAIL_CHARS:])
    return _gsm8k_number(found[-1]) if found else None
  if spec == "dapo_math":
    found = _DAPO_ANSWER.findall(completion[-VERL_TAIL_CHARS:])
    return minerva_normalize(found[-1]) if found else None
  return None


def _math_gold(ground_truth: Any):
  from math_verify import parse  # pylint: disable=g-import-not-at-top
  if ground_truth is None:   # refused at load; str(None) would parse as the symbol 'None'
    return []
  text = ground_truth if isinstance(ground_truth, str) else str(ground_truth)
  if not text.strip():
    return []
  # A bare answer is read as the content of a \boxed{} (so `1/2`, `\frac12`, `\{1,2\}` all parse).
  gold = parse(text if "\\boxed" in text else f"\\boxed{{{text}}}", parsing_timeout=2)
  return gold or parse(text, parsing_timeout=2)


@register_verifier("math", isolated=True, boxes=True)
def math_answer(completion: str, ground_truth: Any, extra_info: dict, boxed: str = "last") -> tuple[float, str]:
  """Symbolic / numeric equivalence of the completion's answer and the ground truth (math-verify).

  With a \\boxed{} in the completion, the boxes `boxed` names are graded, each parsed alone: the
  last one (default), any one or all of them (math-verify by itself would read every box as one
  set, so a corrected answer `\\boxed{12} ... \\boxed{13}` would equal neither). Without a box: a
  final 'answer is' line or the last expression.
  """
  del extra_info
  from math_verify import parse, verify  # pylint: disable=g-import-not-at-top
  if not isinstance(completion, str):
    return 0.0, "not_text"
  gold = _math_gold(ground_truth)
  if not gold:
    return 0.0, BAD_TRUTH
  completion = completion[-TAIL_CHARS:]
  boxes = _graded_boxes(completion, boxed)
  if boxes is None:
    preds = [parse(completion, parsing_timeout=2)]
  else:
    preds = [parse(f"\\boxed{{{b}}}", parsing_timeout=2) if b is not None else [] for b in boxes]
  if not any(preds):
    return 0.0, NO_ANSWER
  ok = _by_policy([bool(p) and verify(gold, p, timeout_seconds=2) for p in preds], boxed)
  return (1.0, "") if ok else (0.0, WRONG)
