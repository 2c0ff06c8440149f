"""Safe Countdown reward: a bounded hand-written parser and exact evaluator for untrusted model output."""
from __future__ import annotations

import collections
import dataclasses
from fractions import Fraction
from typing import Sequence, Union

ANSWER_OPEN = "<answer>"
ANSWER_CLOSE = "</answer>"

# Bounds on untrusted input. Every step below is O(these constants) so one call
# costs well under a millisecond whatever the model writes.
# A Countdown completion is at most a few thousand characters (512 sampled
# tokens); longer text is rejected outright rather than scanned.
MAX_TEXT_CHARS = 1 << 16
# An answer for <= 6 operands is a few dozen characters even with spaces.
MAX_ANSWER_CHARS = 1024
MAX_TOKENS = 256
# Small enough that the recursive-descent parser stays ~100 frames deep,
# far below Python's recursion limit, so no RecursionError is possible.
MAX_PAREN_DEPTH = 32
# Operands are <= 100 (paper) and targets <= 1000; 12 digits keeps every literal
# under MAX_MAGNITUDE.
MAX_LITERAL_DIGITS = 12
# Every intermediate numerator and denominator must stay within this, so the
# Fraction arithmetic works on small integers only.
MAX_MAGNITUDE = 10**12

_DIGITS = frozenset("0123456789")  # ASCII only: str.isdigit() also accepts '²', '٣', ...
_SPACES = frozenset(" \t\r\n")
_OPS = frozenset("+-*/")
_PREC = {"+": 1, "-": 1, "*": 2, "/": 2}

Token = Union[int, str]


@dataclasses.dataclass(frozen=True)
class RewardDetails:
  """What the evaluator found in one completion; `error` is '' iff `correct`.

  error codes: not_text, too_long, no_answer, answer_too_long, bad_char,
  literal_too_long, too_many_tokens, syntax, too_deep, division_by_zero,
  overflow, non_integer_intermediate, wrong_numbers, wrong_value,
  internal_error.
  """
  has_answer: bool  # a complete <answer>...</answer> block was found
  parsed: bool  # its content is a well-formed expression
  uses_numbers: bool  # its literals are exactly the given numbers (as a multiset)
  value: Fraction | None  # exact value; None if it could not be computed
  correct: bool
  error: str = ""

  @property
  def reward(self) -> float:
    return 1.0 if self.correct else 0.0


class _Reject(Exception):
  """Internal control flow: the input is invalid for the reason in args[0]."""


def extract_answer(text: str) -> str | None:
  """Returns the content of the LAST complete `<answer>...</answer>` block, or None.

  As in the papers' Countdown reward (TinyZero), the last block counts, so a
  model may restate its answer. The block is the last closing tag and the
  nearest opening tag before it; content holding another tag (nested or
  doubled blocks) is returned as is and then fails to parse. Texts longer than
  MAX_TEXT_CHARS give None.
  """
  if not isinstance(text, str) or len(text) > MAX_TEXT_CHARS:
    return None
  end = text.rfind(ANSWER_CLOSE)  # C-speed scans: no Python loop over the text
  if end < 0:
    return None
  start = text.rfind(ANSWER_OPEN, 0, end)
  if start < 0:
    return None
  return text[start + len(ANSWER_OPEN):end]


def tokenize_expression(s: str) -> list[Token]:
  """Splits `s` into ints and the characters + - * / ( ); raises _Reject otherwise."""
  if len(s) > MAX_ANSWER_CHARS:
    raise _Reject("answer_too_long")
  tokens: list[Token] = []
  i, n = 0, len(s)
  while i < n:
    c = s[i]
    if c in _SPACES:
      i += 1
      continue
    if c in _DIGITS:
      j = i
      while j < n and s[j] in _DIGITS:
        j += 1
      if j - i > MAX_LITERAL_DIGITS:
        raise _Reject("literal_too_long")
      tokens.append(int(s[i:j]))
      i = j
    elif c in _OPS or c == "(" or c == ")":
      tokens.append(c)
      i += 1
    else:
      raise _Reject("bad_char")
    if len(tokens) > MAX_TOKENS:
      raise _Reject("too_many_tokens")
  return tokens


class _Parser:
  """Recursive descent over binary + - * / with precedence; emits postfix (RPN).

  Grammar: expr := term (('+'|'-') term)* ; term := factor (('*'|'/') factor)* ;
  factor := INT | '(' expr ')'. There is no unary minus or plus: Countdown's
  operations are binary, and the given numbers are positive.
  """

  def __init__(self, tokens: list[Token]):
    self._toks = tokens
    self._i = 0
    self.rpn: list[Token] = []

  def _peek(self) -> Token | None:
    return self._toks[self._i] if self._i < len(self._toks) else None

  def parse(self) -> list[Token]:
    if not self._toks:
      raise _Reject("syntax")
    self._expr(0)
    if self._i != len(self._toks):
      raise _Reject("syntax")
    return self.rpn

  def _expr(self, depth: int) -> None:
    self._term(depth)
    while self._peek() in ("+", "-"):
      op = self._toks[self._i]
      self._i += 1
      self._term(depth)
      self.rpn.append(op)

  def _term(self, depth: int) -> None:
    self._factor(depth)
    while self._peek() in ("*", "/"):
      op = self._toks[self._i]
      self._i += 1
      self._factor(depth)
      self.rpn.append(op)

  def _factor(self, depth: int) -> None:
    tok = self._peek()
    if isinstance(tok, int):
      self._i += 1
      self.rpn.append(tok)
    elif tok == "(":
      if depth >= MAX_PAREN_DEPTH:
        raise _Reject("too_deep")
      self._i += 1
      self._expr(depth + 1)
      if self._peek() != ")":
        raise _Reject("syntax")
      self._i += 1
    else:
      raise _Reject("syntax")


def parse_expression(s: str) -> list[Token]:
  """Parses an arithmetic expression into postfix tokens; raises ValueError if invalid."""
  try:
    return _Parser(tokenize_expression(s)).parse()
  except _Reject as e:
    raise ValueError(f"invalid expression ({e.args[0]})") from None


def _evaluate(rpn: Sequence[Token], integer_intermediate: bool) -> Fraction:
  stack: list[Fraction] = []
  for tok in rpn:
    if isinstance(tok, int):
      stack.append(Fraction(tok))
      continue
    b = stack.pop()
    a = stack.pop()
    if tok == "+":
      r = a + b
    elif tok == "-":
      r = a - b
    elif tok == "*":
      r = a * b
    else:
      if b == 0:
        raise _Reject("division_by_zero")
      r = a / b
    # Checked after every operation, so operands of the next one are bounded too.
    if abs(r.numerator) > MAX_MAGNITUDE or r.denominator > MAX_MAGNITUDE:
      raise _Reject("overflow")
    if integer_intermediate and r.denominator != 1:
      raise _Reject("non_integer_intermediate")
    stack.append(r)
  return stack[0]


def evaluate_expression(s: str, integer_intermediate: bool = False) -> Fraction:
  """Exact value of an expression under the bounds above; raises ValueError if invalid."""
  try:
    return _evaluate(_Parser(tokenize_expression(s)).parse(), integer_intermediate)
  except _Reject as e:
    raise ValueError(f"invalid expression ({e.args[0]})") from None


def _score(completion: str, numbers: Sequence[int], target: int,
           integer_intermediate: bool) -> RewardDetails:
  if not isinstance(completion, str):
    return RewardDetails(False, False, False, None, False, "not_text")
  if len(completion) > MAX_TEXT_CHARS:
    return RewardDetails(False, False, False, None, False, "too_long")
  content = extract_answer(completion)
  if content is None:
    return RewardDetails(False, False, False, None, False, "no_answer")
  try:
    rpn = _Parser(tokenize_expression(content)).parse()
  except _Reject as e:
    return RewardDetails(True, False, False, None, False, e.args[0])
  literals = [t for t in rpn if isinstance(t, int)]
  uses_numbers = collections.Counter(literals) == collections.Counter(int(x) for x in numbers)
  try:
    value = _evaluate(rpn, integer_intermediate)
  except _Reject as e:
    return RewardDetails(True, True, uses_numbers, None, False, e.args[0])
  if not uses_numbers:
    return RewardDetails(True, True, False, value, False, "wrong_numbers")
  if value != int(target):
    return RewardDetails(True, True, True, value, False, "wrong_value")
  return RewardDetails(True, True, True, value, True, "")


def score_countdown(completion: str, numbers: Sequence[int], target: int, *,
                    integer_intermediate: bool = False) -> RewardDetails:
  """Checks a Countdown completion (Gandhi et al., 2024; TinyZero reward rules).

  Correct iff the last `<answer>...</answer>` block holds an expression over
  + - * / and parentheses that uses each of `numbers` exactly once and whose
  exact (Fraction) value equals `target`. With `integer_intermediate`, every
  intermediate result must also be an integer (the easy preset's rule); by
  default fractional intermediates are allowed, as in the papers' evaluator.
  Never raises: unexpected failures give `error='internal_error'`.
  """
  try:
    return _score(completion, numbers, target, integer_intermediate)
  except Exception:  # pylint: disable=broad-except
    # Defence in depth only: the bounded parser above is not expected to get here.
    return RewardDetails(False, False, False, None, False, "internal_error")


def countdown_reward(completion: str, numbers: Sequence[int], target: int, *,
                     integer_intermediate: bool = False, format_score: float = 0.0) -> float:
  """Binary Countdown reward R(x, y) in {0, 1} (see score_countdown).

  `format_score` (TinyZero uses 0.1) is returned for a well-formed answer that
  is wrong; the default 0.0 keeps the reward binary as in the papers' RL runs.
  """
  d = score_countdown(completion, numbers, target, integer_intermediate=integer_intermediate)
  if d.correct:
    return 1.0
  return float(format_score) if d.parsed else 0.0


def format_reward(completion: str) -> float:
  """1.0 iff the completion has an answer block whose content parses as an expression."""
  try:
    content = extract_answer(completion)
    if content is None:
      return 0.0
    _Parser(tokenize_expression(content)).parse()
    return 1.0
  except Exception:  # pylint: disable=broad-except
    # _Reject is the expected path; anything else is likewise a format failure.
    return 0.0
