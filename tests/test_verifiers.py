"""Verifiers: a math equivalence table written from the math, hostile completions bounded, registry, user functions."""
import json
import os
import re
import sys
import textwrap
import time

import pytest

from rl_jax.config_utils import ConfigError
from rl_jax.tasks import sandbox
from rl_jax.tasks import verifiers as v

# (ground truth, completion): the same number / expression / set written another way.
EQUIVALENT = [
    ("1/2", r"\boxed{\frac{1}{2}}"),
    ("0.5", r"\boxed{\frac12}"),                      # decimal vs fraction
    (r"\frac{3}{4}", r"The answer is \boxed{0.75}"),
    ("2", r"\boxed{\frac{4}{2}}"),                    # unreduced fraction
    ("12", r"\boxed{12.0}"),
    (r"\sqrt{8}", r"\boxed{2\sqrt{2}}"),              # simplified radical
    (r"\frac{\sqrt{3}}{3}", r"\boxed{\frac{1}{\sqrt{3}}}"),   # rationalized denominator
    ("-3", r"\boxed{-3}"),
    ("100", r"\boxed{10^2}"),
    ("2^{10}", r"\boxed{1024}"),
    (r"\frac{1}{2}+\frac{1}{3}", r"\boxed{\frac{5}{6}}"),
    ("-\\frac{1}{2}", r"\boxed{-0.5}"),
    (r"\{1, 2\}", r"\boxed{\{2, 1\}}"),              # a set has no order
    ("[0, 1)", r"\boxed{[0,1)}"),
    ("(1, 2)", r"\boxed{(1,2)}"),
    ("x^2+2x+1", r"\boxed{(x+1)^2}"),                 # expanded vs factored polynomial
    (r"\pi", r"\boxed{\pi}"),
    ("0.25", r"\boxed{25\%}"),
    ("3", "First 1+2=3, so the final answer is 3."),   # no box: an 'answer is' line
    ("7", "We get $x=7$. The answer is $7$."),
]
# (ground truth, completion): a different value, or no answer at all.
NOT_EQUIVALENT = [
    ("1/2", r"\boxed{0.51}"),
    ("1/3", r"\boxed{0.33}"),                        # a rounded decimal is not the fraction
    (r"\sqrt{8}", r"\boxed{3}"),
    ("2", r"\boxed{-2}"),
    ("3", r"\boxed{3.1}"),
    ("12", r"\boxed{21}"),
    (r"\pi", r"\boxed{3.14}"),
    (r"\{1,2\}", r"\boxed{\{1,3\}}"),
    ("[0,1)", r"\boxed{[0,1]}"),                      # half-open vs closed interval
    ("(1, 2)", r"\boxed{(2,1)}"),                     # an ordered pair has an order
    ("x^2+1", r"\boxed{(x+1)^2}"),
    ("5", r"\boxed{5} wait, no: \boxed{6}"),          # the last boxed answer counts
    ("12", "I don't know."),
]


# (ground truth, completion, reward under boxed='last', 'any', 'all'): each box is graded alone, as
# the value it states; 'last' is verl's rule (a model may correct itself), 'any' one box equal to
# the truth, 'all' every box. An unclosed box states nothing; without a box an 'answer is' line counts.
BOXES = [
    ("13", r"First \boxed{12}, then corrected: \boxed{13}", 1, 1, 0),
    ("12", r"First \boxed{12}, then corrected: \boxed{13}", 0, 1, 0),
    ("6", r"\boxed{5} wait, no: \boxed{6}", 1, 1, 0),
    ("1/2", r"\boxed{0.5}, that is \boxed{\frac{1}{2}}", 1, 1, 1),   # one value written twice
    ("3", r"\boxed{3} and again \boxed{3.0}", 1, 1, 1),
    (r"\{1,2\}", r"\boxed{1} or \boxed{2}", 0, 0, 0),              # two answers are not the set {1, 2}
    ("7", r"\boxed{7}, or rather \boxed{8", 0, 1, 0),               # the last box is cut off
    ("x+1", r"\boxed{\boxed{x+1}}", 1, 1, 1),                       # nested: the inner box is the last
    ("2", r"so \fbox{2}", 1, 1, 1),
    ("3", "1+2=3, so the final answer is 3.", 1, 1, 1),             # no box
]


# The correctness tests' per-call deadline: a call is cut only if it hangs. A sympy check that takes
# 50 ms on an idle box took over 3 s at load 12 on 2 cores (the equivalence table failed there with
# the hostile tests' 3 s), and a 3x slower machine under load must still grade the table right.
GRADING_TIMEOUT_S = 60.0
# The hostile tests' per-call deadline, set on the same pool for their calls.
HOSTILE_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def pool(user_dir):
  del user_dir  # its workers import the user module too
  p = sandbox.Pool(workers=2, timeout_s=GRADING_TIMEOUT_S, memory_mb=1024)
  yield p
  p.close()


@pytest.fixture
def spawn_s(monkeypatch):
  """The seconds each verifier worker's start-up took during the test. Start-ups (importing the
  verifiers and sympy) never count against a call's deadline, and they take seconds apiece on a
  loaded box: the time bounds below are on the calls alone, the start-ups timed apart."""
  times, spawn = [], sandbox.Pool._spawn  # pylint: disable=protected-access

  def timed_spawn(self):
    t0 = time.monotonic()
    w = spawn(self)
    times.append(time.monotonic() - t0)
    return w
  monkeypatch.setattr(sandbox.Pool, "_spawn", timed_spawn)
  return times


def _batch_bound_s(n_calls: int, workers: int, timeout_s: float) -> float:
  """What `n_calls` bounded calls on `workers` workers may take, start-ups apart: each at most its
  deadline, a worker's calls one after another, plus 1 s per call for killing and replacing a worker
  on a loaded box (a hung call would instead never return)."""
  return -(-n_calls // workers) * (timeout_s + 1.0) + 5.0


def _run(pool, spec, completion, truth, extra=None):
  return pool.run([(spec, ["src", completion, truth, extra or {}])])[0]


def test_math_verifier_agrees_with_the_equivalence_table(pool):
  got = pool.run([("math", ["m", c, g, {}]) for g, c in EQUIVALENT + NOT_EQUIVALENT])
  n = len(EQUIVALENT)
  wrong = [(pair, r) for pair, r in zip(EQUIVALENT, got[:n]) if r != (1.0, "")]
  wrong += [(pair, r) for pair, r in zip(NOT_EQUIVALENT, got[n:]) if r[0] != 0.0]
  assert not wrong
  assert got[-1] == (0.0, v.NO_ANSWER) and got[n] == (0.0, v.WRONG)


def test_boxed_policy_grades_the_last_any_or_every_box(pool):
  """The issue's case ('First \\boxed{12}, then corrected: \\boxed{13}' against 13 scored 0: math-verify
  read both boxes as one set) and the other multi-box rows, under each policy, math and exact_match."""
  for k, policy in enumerate(v.BOX_POLICIES):
    got = pool.run([("math", ["m", c, g, {}, policy]) for g, c, *_ in BOXES])
    assert [r for r, _ in got] == [row[2 + k] for row in BOXES], (policy, got)
    exact = [v.exact_match(c, g, {}, boxed=policy)[0] for g, c, *_ in BOXES[:3] + BOXES[6:7]]
    assert exact == [row[2 + k] for row in BOXES[:3] + BOXES[6:7]], (policy, exact)
  assert v.boxed_answers(r"\boxed{a} \boxed{b{c}} \fbox{d") == [None, "b{c}", "a"]
  assert len(v.boxed_answers(r"\boxed{1}" * 100)) == v.MAX_BOXES   # bounded work per call


# (ground truth, completion, reward) for verl's GSM8K rule: the number after the last '#### '.
GSM8K = [
    ("72", "48 + 24 = 72 clips.\n#### 72", 1.0),
    ("1072", "#### 1,072", 1.0),                                 # a thousands separator is not a digit
    ("72", "#### 70\nno, recount:\n#### 72", 1.0),              # the last answer line counts
    ("72", "#### 72\nno, recount:\n#### 70", 0.0),
    ("-3", "#### -3", 1.0),
    ("Natalia sold 48/2 = 24 clips in May.\n#### 72", "#### 72", 1.0),   # a whole solution as the truth
    ("72", "The answer is 72.", 0.0),                             # no '#### ' line: no answer
    ("72", "#### 72.0", 0.0),                                     # compared as text, as verl does
    ("72", "#### 72" + " " * 400, 0.0),                           # only the last 300 characters are read
]
# (ground truth, completion, reward) for DAPO's rule: the last 'Answer:' line, Minerva-normalized.
DAPO = [
    ("34", "so 17 * 2.\nAnswer: 34", 1.0),
    ("34", "answer : $34$", 1.0),
    (r"\frac{1}{2}", r"Answer: \frac12", 1.0),                    # shorthand \frac spelled out
    ("10", "Answer: 10 degrees", 1.0),                           # units dropped
    ("1000", "Answer: 1,000", 1.0),
    ("5", "Answer: x = 5", 1.0),                                 # the part after the last '='
    (r"\sqrt{2}", r"Answer: \sqrt2", 1.0),
    ("34", "Answer: 35", 0.0),
    ("34", "Answer: 34\nAnswer: 43", 0.0),                       # the last line counts
    ("34", r"\boxed{34}", 0.0),                                  # no 'Answer:' line
]


def test_verls_gsm8k_and_dapo_rules_and_their_sources():
  assert [v.gsm8k(c, g, {})[0] for g, c, _ in GSM8K] == [r for *_, r in GSM8K]
  assert [v.dapo_math(c, g, {})[0] for g, c, _ in DAPO] == [r for *_, r in DAPO]
  assert v.gsm8k("x", "72", {}) == (0.0, v.NO_ANSWER) and v.dapo_math("Answer: 3", "4", {}) == (0.0, v.WRONG)
  from rl_jax.tasks.dataset import DatasetConfig, DatasetTask
  task = DatasetTask(DatasetConfig(verifiers="openai/gsm8k=exact_match"))
  mapping = {s: task.verifier_of(s) for s in ("openai/gsm8k", "lighteval/MATH", "HuggingFaceH4/MATH-500", "math_dapo",
                                               "aime2024", "mine")}
  assert mapping == {"openai/gsm8k": "exact_match", "lighteval/MATH": "math", "HuggingFaceH4/MATH-500": "math",
                     "math_dapo": "dapo_math", "aime2024": "dapo_math", "mine": "math"}   # a user's rule first
  assert DatasetTask(DatasetConfig(verl_scorers=False)).verifier_of("math_dapo") == "math"
  # The reference answer (SFT target, preview's check) is written the way the source's verifier reads it.
  for spec, fn in (("gsm8k", v.gsm8k), ("dapo_math", v.dapo_math), ("exact_match", v.exact_match)):
    assert fn(v.reference_answer(spec, "1,234"), "1,234", {}) == (1.0, ""), spec
  # The answer each states, as maj@k votes on it.
  assert [v.answer_key(spec, text) for spec, text in (
      ("math", r"First \boxed{12}, then \boxed{ 13 }."), ("gsm8k", "#### 1,072"), ("dapo_math", "Answer: 10 degrees"),
      ("math", "no box"), ("countdown", "<answer>1+2</answer>"))] == ["13", "1072", "10", None, None]
  assert v.reads_answers("gsm8k") and not v.reads_answers("countdown") and not v.reads_answers("m:f")


def test_a_null_ground_truth_never_scores(pool):
  """str(None) parsed as the symbol 'None' once made '\\boxed{None}' correct against a null truth."""
  assert _run(pool, "math", r"\boxed{None}", None) == (0.0, v.BAD_TRUTH)


HOSTILE = [
    r"\boxed{9^{9^{9^{9}}}}",                          # a tower no machine can evaluate
    "$9^9^9^9$ is the answer",
    r"\boxed{" + "(" * 5000 + "1" + ")" * 5000 + "}",   # deep nesting
    r"\boxed{" + r"\frac{" * 2000 + "1" + "}{2}" * 2000 + "}",
    "x" * (1 << 20) + r" \boxed{3}",                   # a megabyte of text
    r"\boxed{\frac{1}{",                               # invalid LaTeX
    r"\boxed{\left( \right. \begin{matrix} & \\ \end{pmatrix}}",
    r"\boxed{10^{10^{10}}!}",
    "\x00\ufffd\U0001F600" * 1000,
]


def test_hostile_completions_return_within_bounds_and_name_their_error(pool, spawn_s):
  pool.timeout_s = HOSTILE_TIMEOUT_S
  try:
    t = time.monotonic()
    got = pool.run([("math", ["m", c, "3", {}]) for c in HOSTILE])
    calls_s = time.monotonic() - t - sum(spawn_s)
  finally:
    pool.timeout_s = GRADING_TIMEOUT_S
  # Each call is bounded by its 3 s deadline; 2 workers run them 2 at a time.
  assert calls_s < _batch_bound_s(len(HOSTILE), 2, HOSTILE_TIMEOUT_S), (calls_s, spawn_s)
  for c, (reward, error) in zip(HOSTILE, got):
    assert isinstance(reward, float) and isinstance(error, str), c[:40]
  # The megabyte ends in the right answer: only its tail is read, and it is found.
  # Its grade under a 3 s deadline can run out on a loaded box (0, timeout); graded with the pool's
  # own deadline below, it is right.
  assert got[4] == (1.0, "") or got[4] == (0.0, sandbox.TIMEOUT), got[4]
  assert all(r == 0.0 and e for i, (r, e) in enumerate(got) if i != 4), got
  assert _run(pool, "math", r"\boxed{3}", "3") == (1.0, "")   # the pool still works
  assert _run(pool, "math", HOSTILE[4], "3") == (1.0, "")


USER_MODULE = textwrap.dedent('''
      import os
      def score(data_source, solution_str, ground_truth, extra_info=None):
          return 1.0 if solution_str.strip() == str(ground_truth) else 0.0
      def partial(data_source, solution_str, ground_truth, extra_info=None):
          return {"score": 0.5, "error": "half"}
      def spin(data_source, solution_str, ground_truth, extra_info=None):
          while True:
              pass
      def hog(data_source, solution_str, ground_truth, extra_info=None):
          return len(bytearray(8 << 30))
      def boom(data_source, solution_str, ground_truth, extra_info=None):
          raise RuntimeError("bug")
      def die(data_source, solution_str, ground_truth, extra_info=None):
          os._exit(3)
      def nan(data_source, solution_str, ground_truth, extra_info=None):
          return float("nan")
      def compute_score(solution_str, ground_truth):   # another signature than verl's 4 arguments
          return 1.0
      def flaky(data_source, solution_str, ground_truth, extra_info=None):
          if solution_str == "bad":
              raise ValueError("cannot read " + solution_str)
          return 1.0
  ''')


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory):
  """A directory holding the user module `my_rewards`, on the path of this process and of every
  verifier worker started while the module's tests run (the shared `pool`'s included)."""
  d = tmp_path_factory.mktemp("user")
  (d / "my_rewards.py").write_text(USER_MODULE)
  old = os.environ.get("PYTHONPATH")
  os.environ["PYTHONPATH"] = str(d) + (os.pathsep + old if old else "")
  sys.path.insert(0, str(d))
  yield d
  sys.path.remove(str(d))
  sys.modules.pop("my_rewards", None)
  if old is None:
    os.environ.pop("PYTHONPATH", None)
  else:
    os.environ["PYTHONPATH"] = old


@pytest.fixture
def user_module(user_dir):
  del user_dir
  return "my_rewards"


def test_user_functions_run_bounded_and_a_killed_worker_is_replaced(user_module, spawn_s):
  pool = sandbox.Pool(workers=1, timeout_s=2.0, memory_mb=1024)
  try:
    calls = [(f"{user_module}:{fn}", ["src", "42", "42", {}])
             for fn in ("score", "partial", "spin", "score", "hog", "boom", "die", "nan", "score")]
    t = time.monotonic()
    got = pool.run(calls)
    calls_s = time.monotonic() - t - sum(spawn_s)
    assert len(spawn_s) == 3, spawn_s  # the first worker and the two replacements
    # One call spins forever but is cut at its 2 s deadline; the other eight return at once (the
    # hog's 8 GiB fails at the cap): ~2 s idle, bounded as any 9 calls on one worker are.
    assert calls_s < _batch_bound_s(len(calls), 1, 2.0), (calls_s, spawn_s)
    assert got == [(1.0, ""), (0.5, "half"), (0.0, sandbox.TIMEOUT), (1.0, ""), (0.0, sandbox.MEMORY),
                   (0.0, sandbox.EXCEPTION), (0.0, sandbox.CRASHED), (0.0, "bad_result"), (1.0, "")]
    assert pool.restarts == 2   # the spinning and the dying worker
  finally:
    pool.close()


def test_registry_specs_and_mapping(user_module):
  rules = v.parse_map("gsm8k*=math,count*=countdown,my_*=my_rewards:score", "task.overrides.verifiers")
  assert v.choose("gsm8k_main", rules, "exact_match") == "math"
  assert v.choose("countdown3", rules, "exact_match") == "countdown"
  assert v.choose("my_src", rules, "exact_match") == "my_rewards:score"
  assert v.choose("other", rules, "exact_match") == "exact_match"
  assert not v.is_isolated("countdown") and v.is_isolated("math") and v.is_isolated("my_rewards:score")
  with pytest.raises(ConfigError, match="unknown verifier 'maths'"):
    v.parse_map("a=maths", "task.overrides.verifiers")
  with pytest.raises(ConfigError, match="cannot load verifier 'no_such_mod:f'"):
    v.check_spec("no_such_mod:f", "task.overrides.default_verifier")
  with pytest.raises(ConfigError, match="not source_pattern=verifier"):
    v.parse_map("math", "task.overrides.verifiers")


def test_a_verifier_failing_on_most_calls_stops_with_its_exception_and_row(user_module, pool):
  """A verifier with another signature once gave all-zero rewards and only a verifier_exception
  share; past task.overrides.max_verifier_failures of a batch's calls it now stops the run."""
  from rl_jax.tasks.dataset import DatasetConfig, DatasetTask, VerifierError
  from rl_jax.tasks.records import Record
  rows = [Record("ok", "q", json.dumps("4"), "{}", "", "data.jsonl:1"),
          Record("wrong", "q", json.dumps("4"), "{}", "", "data.jsonl:2"),
          Record("flaky", "q", json.dumps("4"), "{}", "", "data.jsonl:3")]
  task = DatasetTask(DatasetConfig(verifiers=f"wrong={user_module}:compute_score,flaky={user_module}:flaky",
                                   default_verifier="exact_match", verifier_workers=1))
  task._pool = pool  # pylint: disable=protected-access  # the module's warm workers: no start-up
  try:
    # One of four flaky calls fails (under the 0.5 default): scored 0 with its error, no stop.
    verdicts = task.score_batch([rows[2]] * 4 + [rows[0]], ["bad", "a", "b", "c", r"\boxed{4}"])
    assert [(x.reward, x.error) for x in verdicts] == [(0.0, sandbox.EXCEPTION)] + [(1.0, "")] * 4
    assert verdicts[0].detail == "ValueError: cannot read bad"
    with pytest.raises(VerifierError, match=re.escape(
        f"verifier '{user_module}:compute_score' failed on 2 of 2 calls of this batch (more than "
        "task.overrides.max_verifier_failures=0.5): TypeError: compute_score() takes 2 positional arguments "
        "but 4 were given; first at data.jsonl:2 (data_source 'wrong')")):
      task.score_batch([rows[0], rows[1], rows[1]], [r"\boxed{4}", "x", "y"])
  finally:
    task._pool = None  # pylint: disable=protected-access  # the shared pool stays open


def test_countdown_and_exact_match_verifiers():
  truth = {"target": 24, "numbers": [2, 3, 4]}
  assert v.countdown("<answer>(2+4)*4</answer>", truth, {}) == (0.0, "wrong_numbers")
  assert v.countdown("<answer>2*3*4</answer>", truth, {}) == (1.0, "")
  assert v.countdown("<answer>2*3*4</answer>", {"target": 24}, {}) == (0.0, v.BAD_TRUTH)
  assert v.exact_match(r"so \boxed{ Paris }.", "Paris", {}) == (1.0, "")
  assert v.exact_match("Paris", "paris", {}) == (0.0, v.WRONG)
  assert v.exact_match(r"\boxed{a{b}c}", "a{b}c", {}) == (1.0, "")
  assert v.last_boxed(r"\boxed{unclosed") is None


def test_cost_per_call(pool):
  """Reported in the closing note: one pipe round trip + math-verify per call."""
  n = 200
  calls = [("math", ["m", rf"so \boxed{{\frac{{{i}}}{{2}}}}", str(i / 2), {}]) for i in range(n)]
  pool.run(calls[:4])  # warm
  t = time.perf_counter()
  got = pool.run(calls)
  per_call = (time.perf_counter() - t) / n
  assert all(r == (1.0, "") for r in got)
  print(f"math verifier: {per_call * 1e3:.2f} ms per call (2 workers)")
  assert per_call < 0.05


def test_a_step_of_hostile_completions_scores_every_row_through_the_task(spawn_s):
  """The dataset task's batch scoring (what the trainer calls per step) over hostile rows: one verdict
  per row, each hostile one 0 with a named error, the whole batch bounded in time."""
  from rl_jax.tasks.dataset import DatasetConfig, DatasetTask
  from rl_jax.tasks.records import Record
  task = DatasetTask(DatasetConfig(verifiers="cd=countdown,em=exact_match", verifier_workers=2,
                                   verifier_timeout_s=3.0, verifier_memory_mb=1024))
  try:
    rec = lambda src, truth: Record(src, "q", json.dumps(truth), "{}", "", "test:1")
    problems = [rec("math_src", "3")] * len(HOSTILE) + [rec("cd", {"target": 6, "numbers": [1, 2, 3]}),
                                                        rec("em", "Paris")]
    texts = HOSTILE + ["<answer>" + "(" * 10_000 + "</answer>", "x" * (1 << 20)]
    t = time.monotonic()
    verdicts = task.score_batch(problems, texts)
    calls_s = time.monotonic() - t - sum(spawn_s)
    assert calls_s < _batch_bound_s(len(problems), 2, 3.0), (calls_s, spawn_s)
    assert len(verdicts) == len(problems)
    # The megabyte ending in the right boxed answer (graded right, or its 3 s ran out on a loaded box:
    # test_hostile_completions_return_within_bounds_and_name_their_error pins its grade).
    assert verdicts[4].reward == 1.0 or verdicts[4].error == sandbox.TIMEOUT, verdicts[4]
    assert all(v.reward == 0.0 and v.error for i, v in enumerate(verdicts) if i != 4), verdicts
    assert task.verifier_of("cd") == "countdown" and task.verifier_of("other") == "math"
  finally:
    task.close()


def test_identical_completions_of_a_group_are_verified_once():
  from rl_jax.tasks.dataset import DatasetConfig, DatasetTask
  from rl_jax.tasks.records import Record
  task = DatasetTask(DatasetConfig(verifier_workers=1))
  try:
    p = Record("m", "q", json.dumps("4"), "{}", "", "test:1")
    verdicts = task.score_batch([p] * 6, [r"\boxed{4}"] * 3 + [r"\boxed{5}"] * 2 + [r"\boxed{2+2}"])
    assert [v.reward for v in verdicts] == [1, 1, 1, 0, 0, 1]
    assert task._pool.calls == 3   # pylint: disable=protected-access
  finally:
    task.close()
