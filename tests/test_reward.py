"""Countdown reward: hand-checked cases and adversarial-input properties (never raises, always fast)."""
import time
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rl_jax.tasks import reward as R

NUMS, TARGET = (3, 7, 2), 23
# Per call, in CPU time of the calling thread (time.thread_time): what a pathological parser would
# spend (catastrophic backtracking costs seconds) and what load on a shared machine cannot inflate
# (wall time can: a preempted call measured 4.6 ms wall for 0.4 ms CPU beside a test suite). The
# slowest of 1,200 adversarial calls took 0.4 ms CPU, so 0.1 s leaves 250x for a slower machine.
TIME_BOUND_S = 0.1


def ans(expr: str) -> str:
  return f"<answer>{expr}</answer>"


@pytest.mark.parametrize("text", [
    ans("3*7+2"), ans("2+7*3"), ans("(3*7)+2"), ans(" 3 * 7\n+\t2 "), ans("((3*(7))+2)"),
    "Let me think: 3*7=21, 21+2=23. " + ans("3*7+2"),
    ans("1+1") + " no wait " + ans("3*7+2"),  # the last answer counts
    ans("03*7+2"),  # leading zeros read as the number, as the papers' \d+ extraction does
])
def test_correct(text):
  d = R.score_countdown(text, NUMS, TARGET)
  assert d == R.RewardDetails(True, True, True, Fraction(23), True, "")
  assert R.countdown_reward(text, NUMS, TARGET) == 1.0


@pytest.mark.parametrize("text, error, uses_numbers, value", [
    (ans("3+7+2"), "wrong_value", True, Fraction(12)),
    (ans("3*7"), "wrong_numbers", False, Fraction(21)),  # missing number
    (ans("3*7+2+2-2"), "wrong_numbers", False, Fraction(23)),  # number used twice
    (ans("3*7+2+0"), "wrong_numbers", False, Fraction(23)),  # extra number
    (ans("23"), "wrong_numbers", False, Fraction(23)),
    (ans("(7-7)*3+2"), "wrong_numbers", False, Fraction(2)),
])
def test_wrong_value_or_numbers(text, error, uses_numbers, value):
  d = R.score_countdown(text, NUMS, TARGET)
  assert (d.has_answer, d.parsed, d.correct) == (True, True, False)
  assert (d.error, d.uses_numbers, d.value) == (error, uses_numbers, value)
  assert R.countdown_reward(text, NUMS, TARGET) == 0.0
  assert R.countdown_reward(text, NUMS, TARGET, format_score=0.1) == 0.1
  assert R.format_reward(text) == 1.0


def test_division_by_zero():
  d = R.score_countdown(ans("3/(5-5)"), (5, 5, 3), 3)
  assert (d.parsed, d.uses_numbers, d.value, d.correct, d.error) == (
      True, True, None, False, "division_by_zero")
  assert R.countdown_reward(ans("3/(5-5)"), (5, 5, 3), 3) == 0.0


def test_integer_intermediate_rule():
  # 7/2 = 3.5 is an intermediate; the papers' evaluator accepts it, the easy
  # preset's integer_intermediate rule does not.
  text = ans("7/2*4")
  assert R.countdown_reward(text, (7, 2, 4), 14) == 1.0
  d = R.score_countdown(text, (7, 2, 4), 14, integer_intermediate=True)
  assert (d.correct, d.error) == (False, "non_integer_intermediate")
  assert R.countdown_reward(ans("7*4/2"), (7, 2, 4), 14, integer_intermediate=True) == 1.0
  # The final value must still be exactly the target.
  assert R.score_countdown(ans("7/2+4"), (7, 2, 4), 7).value == Fraction(15, 2)


@pytest.mark.parametrize("text, has_answer, error", [
    ("", False, "no_answer"),
    ("3*7+2", False, "no_answer"),
    ("<answer>3*7+2", False, "no_answer"),
    ("3*7+2</answer>", False, "no_answer"),
    ("</answer>3*7+2<answer>", False, "no_answer"),
    (ans(""), True, "syntax"),
    (ans("hello"), True, "bad_char"),
    (ans("3*7+2="), True, "bad_char"),
    (ans("3*7+2)"), True, "syntax"),
    (ans("(3*7+2"), True, "syntax"),
    (ans("3 7 2"), True, "syntax"),
    (ans("3*7++2"), True, "syntax"),
    (ans("-3+7*2"), True, "syntax"),  # no unary operators
    (ans("3*7+2.0"), True, "bad_char"),
    (ans("9**9**9"), True, "syntax"),
    (ans("3*7+2; import os"), True, "bad_char"),
    (ans("__import__('os')"), True, "bad_char"),
    # Nested / doubled blocks: the last block's content holds a tag and fails.
    ("<answer><answer>3*7+2</answer></answer>", True, "bad_char"),
    ("<answer>3*7+2</answer>1</answer>", True, "bad_char"),
    (ans("3*7+2") + ans("1+1"), True, "wrong_numbers"),
])
def test_garbage_and_format(text, has_answer, error):
  d = R.score_countdown(text, NUMS, TARGET)
  assert (d.has_answer, d.correct, d.error) == (has_answer, False, error)
  assert R.countdown_reward(text, NUMS, TARGET, format_score=0.1) == (
      0.1 if error == "wrong_numbers" else 0.0)


@pytest.mark.parametrize("text", [
    ans("\uff13*7+2"),  # fullwidth 3
    ans("\u0663*7+2"),  # Arabic-Indic 3: int() would accept it, the parser must not
    ans("3\u00d77+2"),  # multiplication sign
    ans("3*7\u22122+4"),  # unicode minus
    ans("3*7\u00a0+2"),  # no-break space
    ans("3*7+2\u0301"),  # combining accent
    ans("3*7+\U0001d7d0"),  # mathematical bold 2
    "<answer>3*7+2</answer\u200b>",
    ans("3*7+2\x00"),
])
def test_unicode_rejected(text):
  d = R.score_countdown(text, NUMS, TARGET)
  assert not d.correct
  assert R.countdown_reward(text, NUMS, TARGET) == 0.0


def test_unicode_outside_answer_is_fine():
  assert R.countdown_reward("\u00e9\U0001f600\u0663 " + ans("3*7+2") + " \u2603", NUMS, TARGET) == 1.0


def test_bounds():
  assert R.score_countdown(ans("3*7+2") + " " * R.MAX_TEXT_CHARS, NUMS, TARGET).error == "too_long"
  assert R.score_countdown(ans(" " * (R.MAX_ANSWER_CHARS - 5) + "3*7+2"), NUMS, TARGET).correct
  assert R.score_countdown(ans(" " * R.MAX_ANSWER_CHARS + "3*7+2"), NUMS,
                           TARGET).error == "answer_too_long"
  assert R.score_countdown(ans("+".join(["1"] * 200)), NUMS, TARGET).error == "too_many_tokens"
  assert R.score_countdown(ans("1" * 13), NUMS, TARGET).error == "literal_too_long"
  assert R.score_countdown(ans("1" * 12), NUMS, TARGET).error == "wrong_numbers"
  assert R.score_countdown(ans("999999999999*999999999999"), NUMS, TARGET).error == "overflow"
  assert R.score_countdown(ans("1/999999999999/999999999999"), NUMS, TARGET).error == "overflow"
  depth = R.MAX_PAREN_DEPTH
  assert R.score_countdown(ans("(" * depth + "3*7+2" + ")" * depth), NUMS, TARGET).correct
  assert R.score_countdown(ans("(" * (depth + 1) + "3*7+2" + ")" * (depth + 1)), NUMS,
                           TARGET).error == "too_deep"


def test_not_text_and_bad_arguments_never_raise():
  assert R.score_countdown(None, NUMS, TARGET).error == "not_text"
  assert R.countdown_reward(b"<answer>3*7+2</answer>", NUMS, TARGET) == 0.0
  assert R.countdown_reward(ans("3*7+2"), None, TARGET) == 0.0
  assert R.score_countdown(ans("3*7+2"), NUMS, "x").error == "internal_error"
  assert R.format_reward(None) == 0.0


def test_parse_and_evaluate_helpers():
  assert R.parse_expression("3*(7+2)") == [3, 7, 2, "+", "*"]
  assert R.evaluate_expression("8-4-2") == 2  # left associative
  assert R.evaluate_expression("8/4/2") == 1
  assert R.evaluate_expression("2+3*4") == 14
  for bad in ["", "1+", "(1", "1)", "**", "1 2", "x"]:
    with pytest.raises(ValueError):
      R.parse_expression(bad)
  with pytest.raises(ValueError, match="division_by_zero"):
    R.evaluate_expression("1/0")
  with pytest.raises(ValueError, match="non_integer_intermediate"):
    R.evaluate_expression("1/2*2", integer_intermediate=True)


def _timed_checks(text: str) -> None:
  for fn in (lambda: R.countdown_reward(text, NUMS, TARGET),
             lambda: R.countdown_reward(text, NUMS, TARGET, integer_intermediate=True),
             lambda: R.format_reward(text)):
    t0 = time.thread_time()
    r = fn()
    dt = time.thread_time() - t0
    assert r in (0.0, 1.0) and isinstance(r, float)
    assert dt < TIME_BOUND_S, f"{dt:.3f} s CPU on input of length {len(text)}"
  d = R.score_countdown(text, NUMS, TARGET)
  assert d.error != "internal_error"
  assert d.correct == (d.error == "")


_PIECES = ["<answer>", "</answer>", "<answer", "answer>", "(", ")", "+", "-", "*", "/", "**",
           " ", "\n", "9", "0", "3", "7", "2", "123456789", "\u0663", "\uff19", "x", "<", ">",
           "\U0001f600", "\x00", "\ud800"]


@st.composite
def adversarial_texts(draw):
  kind = draw(st.integers(0, 4))
  if kind == 0:
    body = draw(st.text(max_size=300))
  elif kind == 1:
    body = "".join(draw(st.lists(st.sampled_from(_PIECES), max_size=300)))
  elif kind == 2:
    # One piece repeated up to 2 MB: deep parentheses, huge literals, many tags.
    body = draw(st.sampled_from(_PIECES)) * draw(st.one_of(
        st.integers(0, 2000), st.sampled_from([10**5, 10**6, 2 * 10**6])))
  elif kind == 3:
    # Right at the parser's bounds.
    n = draw(st.integers(0, 2 * R.MAX_PAREN_DEPTH))
    body = "(" * n + draw(st.sampled_from(["3*7+2", "9**9**9", "9" * 20, ""])) + ")" * n
  else:
    body = draw(st.sampled_from(["9**9**9", "9" * 10**6, "(" * 10**5, "<answer>" * 10**5,
                                 "1+" * 500 + "1", "1/" * 200 + "0", "99*" * 100 + "9"]))
  wrap = draw(st.integers(0, 2))
  if wrap == 1:
    body = ans(body)
  elif wrap == 2:
    body = draw(st.text(max_size=20)) + ans(body) + draw(st.text(max_size=20))
  return body


# deadline=None: hypothesis's deadline is wall time, which load inflates; the bound is TIME_BOUND_S.
@settings(max_examples=250, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(adversarial_texts())
def test_adversarial_inputs_never_raise_and_are_fast(text):
  _timed_checks(text)


@settings(max_examples=150, deadline=None, database=None)
@given(st.text())
def test_arbitrary_text_never_raises(text):
  _timed_checks(text)


@pytest.mark.parametrize("text", [
    "(" * 100_000, ans("(" * 100_000), ans("9**9**9"), ans("9" * 10**6), "<answer>" * 10**5,
    "</answer>" * 10**5, ans("(" * 30 + "9**9" + ")" * 30), ans("1+" * 511 + "1"),
    ans("(" * 300 + ")" * 300), "x" * (1 << 20), ans("3*7+2") * 5000,
])
def test_named_adversarial_inputs(text):
  _timed_checks(text)
