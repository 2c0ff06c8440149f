"""Countdown generator, prompt formats and task registry: verified solutions, determinism, disjoint splits."""
import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_jax import tasks
from rl_jax.config_utils import ConfigError, from_dict
from rl_jax.tasks import countdown as cd
from rl_jax.tasks import reward as R
from rl_jax.tasks.tokenizer import CharTokenizer

PRESET_NAMES = ["paper", "easy"]


def key(p: cd.Problem):
  return tuple(sorted(p.numbers)), p.target


@pytest.fixture(scope="module", params=PRESET_NAMES)
def generated(request):
  cfg = cd.PRESETS[request.param]
  return cfg, {s: cd.make_problems(cfg, 0, s, 0, 300 if s == "train" else 100) for s in cd.SPLITS}


def test_emitted_solutions_score_one(generated):
  cfg, probs = generated
  for split, ps in probs.items():
    for p in ps:
      assert R.countdown_reward(R.ANSWER_OPEN + p.solution + R.ANSWER_CLOSE, p.numbers, p.target,
                                integer_intermediate=cfg.integer_intermediate) == 1.0, p
      # Also through both text formats, as the SFT / RL jobs see them.
      for style in ("compact", "paper"):
        text = cd.response_prefix(style) + cd.format_completion(p, style)
        assert R.countdown_reward(text, p.numbers, p.target,
                                  integer_intermediate=cfg.integer_intermediate) == 1.0


def test_problems_in_range(generated):
  cfg, probs = generated
  for ps in probs.values():
    for p in ps:
      assert len(p.numbers) == cfg.n_operands
      assert all(cfg.min_number <= x <= cfg.max_number for x in p.numbers)
      assert cfg.min_target <= p.target <= cfg.max_target
      assert isinstance(p.target, int) and all(isinstance(x, int) for x in p.numbers)
      assert set(p.solution) <= set("0123456789()" + "".join(cfg.ops))
      if cfg.integer_intermediate:
        R.evaluate_expression(p.solution, integer_intermediate=True)  # raises if violated


def test_splits_are_disjoint(generated):
  cfg, probs = generated
  train, ev = {key(p) for p in probs["train"]}, {key(p) for p in probs["eval"]}
  assert not train & ev
  for split, ps in probs.items():
    assert all(cd.split_of(p.numbers, p.target, cfg.eval_fraction) == split for p in ps)
  assert [p.numbers for p in probs["train"][:20]] != [p.numbers for p in probs["eval"][:20]]


def test_problems_vary(generated):
  _, probs = generated
  assert len({key(p) for p in probs["train"]}) > 150
  assert len({p.target for p in probs["train"]}) > 20


def test_deterministic():
  for name in PRESET_NAMES:
    cfg = cd.PRESETS[name]
    batch = cd.make_problems(cfg, 3, "train", 10, 5)
    # Any index alone, in any order, gives the same problem (resume-safe).
    assert [cd.make_problem(cfg, 3, "train", i) for i in (14, 13, 12, 11, 10)] == batch[::-1]
    assert cd.make_problems(cfg, 4, "train", 10, 5) != batch


def test_golden_values():
  # Pins the data stream: if this changes, resumed runs would see different data.
  assert cd.make_problem(cd.PRESETS["easy"], 0, "train", 0) == cd.Problem((8, 4, 8), 12, "8-4+8")
  assert cd.make_problem(cd.PRESETS["paper"], 0, "train", 0) == cd.Problem(
      (78, 69, 35, 17), 129, "78+69+17-35")
  assert cd.make_problem(cd.PRESETS["easy"], 0, "eval", 0) == cd.Problem((8, 6, 1), 14, "8+6*1")


@settings(max_examples=40, deadline=None, database=None)
@given(st.integers(0, 2**63), st.integers(0, 2**40), st.sampled_from(cd.SPLITS))
def test_any_seed_and_index(seed, index, split):
  cfg = cd.PRESETS["easy"]
  p = cd.make_problem(cfg, seed, split, index)
  assert cd.split_of(p.numbers, p.target, cfg.eval_fraction) == split
  assert R.countdown_reward(cd.response_prefix() + cd.format_completion(p), p.numbers, p.target,
                            integer_intermediate=True) == 1.0


def test_bad_arguments():
  cfg = cd.PRESETS["easy"]
  for split in ("test", "validation", ""):
    with pytest.raises(ValueError, match="split"):
      cd.make_problem(cfg, 0, split, 0)
  with pytest.raises(ValueError, match="seed"):
    cd.make_problem(cfg, -1, "train", 0)
  with pytest.raises(ValueError, match="index"):
    cd.make_problem(cfg, 0, "train", 1.5)


def test_infeasible_config_fails_clearly(monkeypatch):
  monkeypatch.setattr(cd, "MAX_ATTEMPTS", 50)
  cfg = cd.CountdownConfig(n_operands=2, min_number=1, max_number=1, ops=("+",), min_target=5,
                           max_target=5)
  with pytest.raises(RuntimeError, match="unreachable"):
    cd.make_problem(cfg, 0, "train", 0)


@pytest.mark.parametrize("kwargs, key_name", [
    (dict(n_operands=1), "n_operands"),
    (dict(n_operands=7), "n_operands"),
    (dict(min_number=0), "min_number"),
    (dict(min_number=5, max_number=4), "min_number"),
    (dict(min_target=5, max_target=4), "min_target"),
    (dict(ops=()), "ops"),
    (dict(ops=("+", "+")), "ops"),
    (dict(ops=("+", "**")), "ops"),
    (dict(prompt_style="chat"), "prompt_style"),
    (dict(eval_fraction=0.0), "eval_fraction"),
])
def test_config_validation(kwargs, key_name):
  with pytest.raises(ConfigError, match=key_name):
    cd.CountdownConfig(**kwargs)


def test_config_from_dict_and_presets():
  cfg = from_dict(cd.CountdownConfig, {"n_operands": 3, "ops": ["+", "*"]})
  assert cfg.ops == ("+", "*") and cfg.n_operands == 3
  with pytest.raises(ConfigError, match="ops_list"):
    from_dict(cd.CountdownConfig, {"ops_list": ["+"]})
  with pytest.raises(ConfigError, match="prompt_style"):
    from_dict(cd.CountdownConfig, {"prompt_style": "chat"})
  paper = cd.PRESETS["paper"]
  assert (paper.n_operands, paper.min_number, paper.max_number, paper.min_target,
          paper.max_target, paper.ops) == (4, 1, 100, 1, 1000, ("+", "-", "*", "/"))
  assert cd.preset("easy", max_target=30).max_target == 30
  with pytest.raises(ConfigError, match="preset"):
    cd.preset("hard")
  with pytest.raises(dataclasses.FrozenInstanceError):
    paper.n_operands = 3


def test_formats():
  p = cd.Problem((44, 19, 35, 7), 98, "44+19+35")
  assert cd.format_prompt(p) == "nums 44 19 35 7 target 98 <answer>"
  assert cd.format_completion(p) == "44+19+35</answer>"
  assert cd.format_prompt(p, "paper") == (
      "Using the numbers [44, 19, 35, 7], create an equation that equals 98. You can use basic "
      "arithmetic operations (+, -, *, /) and each number must be used exactly once. Return the "
      "final answer in <answer> </answer> tags, for example <answer> (1 + 2) / 3 </answer>.")
  assert "(+, -, *)" in cd.format_prompt(p, "paper", ("+", "-", "*"))
  assert cd.format_completion(p, "paper") == "<answer> 44 + 19 + 35 </answer>"
  assert cd.spaced("(44+19)-35/7") == "(44 + 19) - 35 / 7"
  assert cd.response_prefix("compact") == "<answer>" and cd.response_prefix("paper") == ""
  with pytest.raises(ValueError):
    cd.format_prompt(p, "chat")


def test_registry():
  # The registry is open (a task module adds names); Countdown registers exactly these two.
  assert tasks.list_tasks() == sorted(tasks.list_tasks())
  assert [n for n in tasks.list_tasks() if n.startswith("countdown")] == ["countdown", "countdown_easy"]
  t = tasks.get_task("countdown")
  assert isinstance(t, tasks.Task) and isinstance(t, tasks.CountdownTask)
  assert t.config == cd.PRESETS["paper"] and t.config.prompt_style == "paper"
  e = tasks.get_task("countdown_easy")
  assert e.config == cd.PRESETS["easy"]
  p = e.make_problem(0, "train", 0)
  assert e.make_problems(0, "train", 0, 2)[0] == p
  assert e.prompt(p) == "nums 8 4 8 target 12 <answer>"
  assert e.completion(p) == "8-4+8</answer>"
  assert e.reward(p, e.completion(p)) == 1.0
  assert e.reward(p, "8+4-8</answer>") == 0.0
  assert e.reward_details(p, "8+4-8</answer>").error == "wrong_value"
  assert not e.reward_details(p, e.completion(p)).error   # '' when correct
  assert e.reward(p, None) == 0.0
  pp = t.make_problem(0, "train", 0)
  assert t.reward(pp, "I think " + t.completion(pp)) == 1.0
  assert tasks.get_task("countdown", {"n_operands": 3}).config.n_operands == 3
  with pytest.raises(ConfigError, match="countdown_hard"):
    tasks.get_task("countdown_hard")
  with pytest.raises(ConfigError, match="bogus"):
    tasks.get_task("countdown", {"bogus": 1})


def test_register_task_protocol_and_duplicates():
  """A registered factory must return a Task; a name registers once."""
  with pytest.raises(ValueError, match="already registered"):
    tasks.register_task("countdown")(lambda overrides: None)

  class NotATask:
    name = "not_a_task"

  tasks.register_task("_test_not_a_task")(lambda overrides: NotATask())
  try:
    with pytest.raises(TypeError, match="Task protocol"):
      tasks.get_task("_test_not_a_task")
  finally:
    tasks.base._TASKS.pop("_test_not_a_task")  # pylint: disable=protected-access


def test_char_tokenizer_covers_both_formats(generated):
  cfg, probs = generated
  tok = CharTokenizer()
  for p in probs["train"][:50]:
    for style in ("compact", "paper"):
      text = cd.format_prompt(p, style, cfg.ops) + cd.format_completion(p, style)
      assert tok.decode(tok.encode(text)) == text
  task = tasks.get_task("countdown_easy")
  lens = [len(tok.encode(task.prompt(p) + task.completion(p))) for p in probs["train"]]
  assert max(lens) <= 64  # the easy task is short enough for a tiny char-level model
