"""Countdown (Gandhi et al., 2024): reach the target using every given number once with + - * /."""
from __future__ import annotations

import dataclasses
import hashlib
from fractions import Fraction
from typing import Literal, Sequence

from rl_jax.config_utils import ConfigError, from_dict, require
from rl_jax.tasks import reward as reward_lib
from rl_jax.tasks.base import register_task

ALL_OPS = ("+", "-", "*", "/")
PromptStyle = Literal["compact", "paper"]
Split = Literal["train", "eval"]
SPLITS = ("train", "eval")
_PREC = {"+": 1, "-": 1, "*": 2, "/": 2}

# Generation is rejection sampling; this bounds it so an infeasible config
# fails with a message instead of looping.
MAX_ATTEMPTS = 100_000
# Bumping a version string changes every generated problem (breaks resume).
_STREAM_VERSION = b"rl_jax.countdown/v1"
_SPLIT_VERSION = b"rl_jax.countdown.split/v1"


@dataclasses.dataclass(frozen=True)
class CountdownConfig:
  """Countdown problem distribution, evaluation rules and prompt style.

  integer_intermediate: every intermediate value must be an integer, both in
    generated solutions and in the reward (which then rejects e.g. `7/2*4`).
    The papers' evaluator allows fractions, so the `paper` preset leaves it off.
  eval_fraction: share of distinct problems (number multiset, target) that
    belong to the eval split; the other share is train. The partition is a
    fixed hash of the problem, so the two splits never share a problem however
    many are drawn (see make_problem).
  """
  n_operands: int = 4
  min_number: int = 1
  max_number: int = 100
  min_target: int = 1
  max_target: int = 1000
  ops: tuple[str, ...] = ALL_OPS
  integer_intermediate: bool = False
  prompt_style: PromptStyle = "paper"
  eval_fraction: float = 0.1

  def __post_init__(self):
    require(2 <= self.n_operands <= 6, "n_operands",
            f"must be in [2, 6] (reward bounds are sized for that), got {self.n_operands}")
    require(1 <= self.min_number <= self.max_number, "min_number",
            f"need 1 <= min_number <= max_number, got {self.min_number}, {self.max_number}")
    require(self.max_number < 10**6, "max_number", f"must be < 10**6, got {self.max_number}")
    require(self.min_target <= self.max_target, "min_target",
            f"need min_target <= max_target, got {self.min_target}, {self.max_target}")
    require(abs(self.min_target) < 10**9 and abs(self.max_target) < 10**9, "max_target",
            "targets must be within +-10**9")
    require(len(self.ops) > 0 and len(set(self.ops)) == len(self.ops)
            and all(op in ALL_OPS for op in self.ops), "ops",
            f"must be distinct elements of {list(ALL_OPS)}, got {list(self.ops)}")
    require(self.prompt_style in ("compact", "paper"), "prompt_style",
            f"{self.prompt_style!r} is not one of ['compact', 'paper']")
    require(0.0 < self.eval_fraction < 1.0, "eval_fraction",
            f"must be in (0, 1), got {self.eval_fraction}")


PRESETS: dict[str, CountdownConfig] = {
    # Countdown as in the papers (TinyZero's Countdown-Tasks): 4 numbers in
    # 1..100, integer target in 1..1000, fractional intermediates allowed.
    "paper": CountdownConfig(),
    # Sized for a tiny char-level model on CPU: three one-digit numbers, no
    # division, so a solution is ~5 characters and a model must only learn
    # small-integer arithmetic to find one.
    "easy": CountdownConfig(
        n_operands=3, min_number=1, max_number=9, min_target=1, max_target=40,
        ops=("+", "-", "*"), integer_intermediate=True, prompt_style="compact"),
}


def preset(name: str, **overrides) -> CountdownConfig:
  """A named preset ('paper' or 'easy'), with optional validated field overrides."""
  if name not in PRESETS:
    raise ConfigError(f"unknown Countdown preset {name!r}; valid: {sorted(PRESETS)}")
  if not overrides:
    return PRESETS[name]
  return from_dict(CountdownConfig, {**dataclasses.asdict(PRESETS[name]), **overrides})


@dataclasses.dataclass(frozen=True)
class Problem:
  """One Countdown instance; `solution` is a verified expression in compact form (no spaces)."""
  numbers: tuple[int, ...]
  target: int
  solution: str


class _Stream:
  """Deterministic integers from a hash of (seed, split, index, counter).

  Hash-based rather than numpy/`random` generators, whose streams are not
  guaranteed across versions: a resumed run must see exactly the same data.
  """

  def __init__(self, seed: int, split: str, index: int):
    self._key = b"%s/%d/%s/%d/" % (_STREAM_VERSION, seed, split.encode(), index)
    self._count = 0

  def below(self, n: int) -> int:
    """Uniform in [0, n) (64-bit hash; modulo bias < n / 2**64)."""
    h = hashlib.blake2b(self._key + str(self._count).encode(), digest_size=8).digest()
    self._count += 1
    return int.from_bytes(h, "little") % n

  def between(self, lo: int, hi: int) -> int:
    return lo + self.below(hi - lo + 1)


def split_of(numbers: Sequence[int], target: int, eval_fraction: float) -> Split:
  """The split a problem belongs to: a fixed hash of (sorted numbers, target)."""
  key = b"%s/%s/%d" % (_SPLIT_VERSION, ",".join(map(str, sorted(numbers))).encode(), target)
  u = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") / 2.0**64
  return "eval" if u < eval_fraction else "train"


@dataclasses.dataclass(frozen=True)
class _Node:
  value: Fraction
  text: str  # compact rendering with minimal parentheses
  prec: int  # 3 for a literal, else the precedence of its top operator
  op: str = ""


def _combine(a: _Node, b: _Node, op: str) -> _Node:
  """Renders `a op b` with the fewest parentheses that keep the same value."""
  p = _PREC[op]
  left = a.text if a.prec >= p else f"({a.text})"
  # Same-precedence right operands need parentheses under - and / (a-(b-c)).
  right_bare = b.prec > p or (b.prec == p and op in ("+", "*"))
  right = b.text if right_bare else f"({b.text})"
  if op == "+":
    v = a.value + b.value
  elif op == "-":
    v = a.value - b.value
  elif op == "*":
    v = a.value * b.value
  else:
    v = a.value / b.value
  return _Node(v, f"{left}{op}{right}", p, op)


def _op_ok(a: Fraction, b: Fraction, op: str, cfg: CountdownConfig) -> bool:
  if op == "/":
    if b == 0:
      return False
    if cfg.integer_intermediate and (a / b).denominator != 1:
      return False
  return True


def _random_solution(numbers: list[int], cfg: CountdownConfig, rng: _Stream) -> _Node | None:
  """Combines two random pool entries with a random allowed op until one remains.

  This is the game's own move ("pick two numbers, replace them by their
  combination"), so every expression tree over the numbers is reachable.
  """
  pool = [_Node(Fraction(x), str(x), 3) for x in numbers]
  while len(pool) > 1:
    a = pool.pop(rng.below(len(pool)))
    b = pool.pop(rng.below(len(pool)))
    ops = [op for op in cfg.ops if _op_ok(a.value, b.value, op, cfg)]
    if not ops:
      return None
    node = _combine(a, b, ops[rng.below(len(ops))])
    v = node.value
    if abs(v.numerator) > reward_lib.MAX_MAGNITUDE or v.denominator > reward_lib.MAX_MAGNITUDE:
      return None
    pool.append(node)
  return pool[0]


def make_problem(cfg: CountdownConfig, seed: int, split: Split, index: int) -> Problem:
  """Problem number `index` of `split`, a pure function of (cfg, seed, split, index).

  Draws numbers uniformly (with repetition) and a random expression over them,
  evaluates it exactly and keeps it if its value is an integer in the target
  range and the problem (number multiset, target) hashes into `split`
  (split_of). Train and eval therefore draw from disjoint problem sets, and
  each (seed, split, index) has its own random stream, so any index can be
  generated alone, in any order, after a restart. The numbers are shown in the
  order drawn; the solution is re-checked with the reward function.
  """
  if split not in SPLITS:
    raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
  if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
    raise ValueError(f"seed must be a non-negative int, got {seed!r}")
  if isinstance(index, bool) or not isinstance(index, int) or index < 0:
    raise ValueError(f"index must be a non-negative int, got {index!r}")
  rng = _Stream(seed, split, index)
  for _ in range(MAX_ATTEMPTS):
    numbers = [rng.between(cfg.min_number, cfg.max_number) for _ in range(cfg.n_operands)]
    node = _random_solution(numbers, cfg, rng)
    if node is None or node.value.denominator != 1:
      continue
    target = int(node.value)
    if not cfg.min_target <= target <= cfg.max_target:
      continue
    if split_of(numbers, target, cfg.eval_fraction) != split:
      continue
    # Guards the minimal-parentheses rendering against the real evaluator.
    details = reward_lib.score_countdown(
        f"{reward_lib.ANSWER_OPEN}{node.text}{reward_lib.ANSWER_CLOSE}", numbers, target,
        integer_intermediate=cfg.integer_intermediate)
    if not details.correct:
      raise AssertionError(f"generated solution {node.text!r} fails: {details}")
    return Problem(tuple(numbers), target, node.text)
  raise RuntimeError(
      f"no Countdown problem found in {MAX_ATTEMPTS} attempts for {cfg} (split={split!r}); "
      "the target range is probably unreachable with these numbers and ops")


def make_problems(cfg: CountdownConfig, seed: int, split: Split, start: int,
                  count: int) -> list[Problem]:
  """Problems start, ..., start + count - 1 of `split` (a batch for one step)."""
  return [make_problem(cfg, seed, split, i) for i in range(start, start + count)]


def spaced(expression: str) -> str:
  """`(44+19)-35/7` -> `(44 + 19) - 35 / 7` (the papers' style; no unary ops to confuse)."""
  return "".join(f" {c} " if c in "+-*/" else c for c in expression)


def format_prompt(problem: Problem, prompt_style: PromptStyle = "compact",
                  ops: Sequence[str] = ALL_OPS) -> str:
  """The prompt text.

  compact (char-level models): `nums 3 7 2 target 23 <answer>`; the answer
    block is opened by the prompt, so the completion is `3*7+2</answer>`.
  paper: a TinyZero-style instruction without the <think> part; the model
    writes the whole `<answer> ... </answer>` block itself.
  """
  nums = " ".join(map(str, problem.numbers))
  if prompt_style == "compact":
    return f"nums {nums} target {problem.target} {reward_lib.ANSWER_OPEN}"
  if prompt_style == "paper":
    listed = ", ".join(map(str, problem.numbers))
    op_list = ", ".join(ops)
    example = f"(1 {ops[0]} 2) {ops[-1]} 3"
    return (f"Using the numbers [{listed}], create an equation that equals {problem.target}. "
            f"You can use basic arithmetic operations ({op_list}) and each number must be "
            "used exactly once. Return the final answer in <answer> </answer> tags, "
            f"for example <answer> {example} </answer>.")
  raise ValueError(f"prompt_style must be 'compact' or 'paper', got {prompt_style!r}")


def response_prefix(prompt_style: PromptStyle = "compact") -> str:
  """The part of the answer block the prompt already contains (prepended before scoring)."""
  return reward_lib.ANSWER_OPEN if prompt_style == "compact" else ""


def format_completion(problem: Problem, prompt_style: PromptStyle = "compact") -> str:
  """The SFT target that follows format_prompt: `3*7+2</answer>` or `<answer> 3 * 7 + 2 </answer>`."""
  if prompt_style == "compact":
    return f"{problem.solution}{reward_lib.ANSWER_CLOSE}"
  if prompt_style == "paper":
    return f"{reward_lib.ANSWER_OPEN} {spaced(problem.solution)} {reward_lib.ANSWER_CLOSE}"
  raise ValueError(f"prompt_style must be 'compact' or 'paper', got {prompt_style!r}")


# --- The Countdown tasks (registered under rl_jax.tasks.get_task) ----------------------------

@dataclasses.dataclass(frozen=True)
class CountdownTask:
  """Countdown bound to its config; implements rl_jax.tasks.base.Task."""
  name: str
  config: CountdownConfig

  def make_problem(self, seed: int, split: Split, index: int) -> Problem:
    return make_problem(self.config, seed, split, index)

  def make_problems(self, seed: int, split: Split, start: int, count: int) -> list[Problem]:
    return make_problems(self.config, seed, split, start, count)

  def prompt(self, problem: Problem) -> str:
    return format_prompt(problem, self.config.prompt_style, self.config.ops)

  def completion(self, problem: Problem) -> str:
    """The SFT target following prompt(problem) (tokenizer adds eos)."""
    return format_completion(problem, self.config.prompt_style)

  @property
  def response_prefix(self) -> str:
    """Answer-block text already in the prompt; reward() prepends it to the completion."""
    return response_prefix(self.config.prompt_style)

  def reward_details(self, problem: Problem, completion: str) -> reward_lib.RewardDetails:
    """Scores the sampled completion (the text after the prompt); never raises."""
    text = self.response_prefix + completion if isinstance(completion, str) else completion
    return reward_lib.score_countdown(text, problem.numbers, problem.target,
                                      integer_intermediate=self.config.integer_intermediate)

  def reward(self, problem: Problem, completion: str) -> float:
    """Binary reward in {0, 1} (see reward.score_countdown); never raises."""
    return self.reward_details(problem, completion).reward


@register_task("countdown")
def _countdown_paper(overrides) -> CountdownTask:
  """The papers' distribution (PRESETS['paper']), with CountdownConfig overrides."""
  return CountdownTask("countdown", preset("paper", **overrides))


@register_task("countdown_easy")
def _countdown_easy(overrides) -> CountdownTask:
  """Short problems for the tiny CPU model (PRESETS['easy'])."""
  return CountdownTask("countdown_easy", preset("easy", **overrides))
