"""Dataset task: verl schema in jsonl / parquet, field mapping, errors, order and resume, filtering, chat templates."""
import collections
import json
import os
import re

import pytest
from conftest import need

from rl_jax.config_utils import ConfigError
from rl_jax.tasks import arith, get_task, order, records
from rl_jax.tasks import build as task_build
from rl_jax.tasks.dataset import interleave
from rl_jax.tasks.hf_tokenizer import HFTokenizer


@pytest.fixture(scope="module")
def data(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("math"))
  arith.write(out, train=300, eval_count=24)
  return out


@pytest.fixture(scope="module")
def tok(data):
  return HFTokenizer.from_dir(os.path.join(data, "tokenizer"))


def _task(data, tok=None, limit=64, **over):
  over = {"train_files": f"{data}/train_arith_add.jsonl,{data}/train_arith_mul.parquet",
          "eval_files": f"{data}/eval_*.parquet", "solution_key": "extra_info.solution", **over}
  t = get_task("dataset", over)
  if tok is not None:
    t.bind(tok, limit)
  return t


def test_jsonl_and_parquet_read_the_same_records(data):
  fields = records.Fields()
  for s in arith.SOURCES:
    a = records.read_records([f"{data}/train_{s}.jsonl"], fields)
    b = records.read_records([f"{data}/train_{s}.parquet"], fields)
    assert [(r.data_source, r.prompt, r.ground_truth, r.extra_info) for r in a] == \
           [(r.data_source, r.prompt, r.ground_truth, r.extra_info) for r in b]
    assert a[0].data_source == s and a[0].prompt[0][0] == "system"


def test_string_prompts_and_a_field_mapping(tmp_path):
  path = tmp_path / "other.jsonl"
  rows = [{"question": "What is 2+3?", "meta": {"answer": 5}}, {"question": "What is 4*2?", "meta": {"answer": 8}}]
  records.write_jsonl(str(path), rows)
  fields = records.Fields(prompt="question", source="", answer="meta.answer", extra="", default_source="toy")
  recs = records.read_records([str(path)], fields)
  assert [(r.data_source, r.prompt, r.ground_truth) for r in recs] == [
      ("toy", "What is 2+3?", 5), ("toy", "What is 4*2?", 8)]


@pytest.mark.parametrize("row,message", [
    ({"data_source": "a", "reward_model": {"ground_truth": "1"}}, "no field 'prompt'"),
    ({"prompt": [{"role": "user"}], "data_source": "a", "reward_model": {"ground_truth": "1"}}, "'prompt'[0]"),
    ({"prompt": [{"role": "robot", "content": "x"}], "data_source": "a",
      "reward_model": {"ground_truth": "1"}}, "role 'robot'"),
    ({"prompt": "hi", "reward_model": {"ground_truth": "1"}}, "no field 'data_source'"),
    ({"prompt": "hi", "data_source": "a"}, "no field 'reward_model.ground_truth'"),
    # A row without a ground truth is refused at load (a null once let '\\boxed{None}' score 1).
    ({"prompt": "hi", "data_source": "a", "reward_model": {"ground_truth": None}},
     "field 'reward_model.ground_truth' is null"),
    ({"prompt": "hi", "data_source": "a", "reward_model": {"ground_truth": " "}},
     "field 'reward_model.ground_truth' is ' '"),
    ({"prompt": "hi", "data_source": "a", "reward_model": {"ground_truth": []}},
     "field 'reward_model.ground_truth' is []"),
    ({"prompt": "hi", "data_source": "a", "reward_model": {"ground_truth": float("nan")}},
     "field 'reward_model.ground_truth' is nan"),
])
def test_bad_rows_name_the_file_row_and_field(tmp_path, row, message):
  path = tmp_path / "bad.jsonl"
  good = {"prompt": "ok", "data_source": "a", "reward_model": {"ground_truth": "1"}}
  records.write_jsonl(str(path), [good, row])
  with pytest.raises(ValueError, match=re.escape(f"{path}:2: ") + ".*" + re.escape(message)):
    records.read_records([str(path)], records.Fields())


def test_a_null_ground_truth_in_parquet_names_the_file_and_row(tmp_path):
  path = str(tmp_path / "p.parquet")
  records.write_parquet(path, [{"prompt": "a", "data_source": "s", "reward_model": {"ground_truth": "1"}},
                               {"prompt": "b", "data_source": "s", "reward_model": {"ground_truth": None}}])
  with pytest.raises(records.DataError, match=re.escape(f"{path}:2: field 'reward_model.ground_truth' is null")):
    records.read_records([path], records.Fields())


def test_a_prompt_stored_as_json_text_is_read_as_its_messages(tmp_path):
  """pandas writes a list column to a file as its JSON text: such a prompt is decoded into chat
  messages; any other string, one starting with '[' included, stays a plain prompt."""
  path = str(tmp_path / "p.jsonl")
  msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
  texts = [json.dumps(msgs), "[1, 2] sorted?", '["a", "b"]', "[not json"]
  records.write_jsonl(path, [{"prompt": t, "data_source": "s", "reward_model": {"ground_truth": "4"}}
                             for t in texts])
  got = [r.prompt for r in records.read_records([path], records.Fields())]
  assert got == [(("system", "Be brief."), ("user", "2+2?"))] + texts[1:]
  records.write_jsonl(path, [{"prompt": json.dumps([{"role": "robot", "content": "x"}]), "data_source": "s",
                              "reward_model": {"ground_truth": "4"}}])
  with pytest.raises(records.DataError, match=re.escape(f"{path}:1: field 'prompt'[0] has role 'robot'")):
    records.read_records([path], records.Fields())


def test_bad_json_and_paths_are_named(tmp_path):
  path = tmp_path / "broken.jsonl"
  path.write_text('{"prompt": "a"}\n{not json\n')
  with pytest.raises(ValueError, match=f"{path}:2: not valid JSON"):
    list(records.read_rows(str(path)))
  with pytest.raises(ConfigError, match="task.train_files.*no file matches"):
    records.expand(str(tmp_path / "nothing_*.jsonl"), "task.train_files")
  with pytest.raises(ConfigError, match="task.eval_files.*no such file"):
    records.expand(str(tmp_path / "missing.parquet"), "task.eval_files")
  (tmp_path / "x.csv").write_text("a\n")
  with pytest.raises(ConfigError, match="neither .jsonl nor .parquet"):
    records.expand(str(tmp_path / "x.csv"), "task.train_files")


def test_files_only_for_the_dataset_task():
  with pytest.raises(ConfigError, match="task.train_files.*only task.name='dataset'"):
    task_build.make_task(task_build.TaskConfig(name="countdown_easy", train_files="/x.jsonl"))
  with pytest.raises(ConfigError, match="task.train_files.*empty"):
    get_task("dataset", {}).bind(object(), 64)


def test_every_epoch_is_a_permutation_and_seeds_differ():
  n = 37
  o = order.Order({"all": n}, seed=3)
  seen = o.items(0, 3 * n)
  for e in range(3):
    assert sorted(seen[e * n:(e + 1) * n]) == list(range(n))
  assert seen[:n] != seen[n:2 * n]  # a fresh shuffle per epoch
  assert seen[:n] != order.Order({"all": n}, seed=4).items(0, n)
  assert order.Order({"all": n}, seed=3, shuffle=False).items(0, n) == list(range(n))


def test_weighted_sources_follow_their_weights_and_never_repeat_within_a_source_epoch():
  sizes = {"a": 50, "b": 400}
  o = order.Order(sizes, seed=0, weights={"a": 1.0, "b": 3.0})
  items = o.items(0, 4000)
  is_a = [i < 50 for i in items]
  assert abs(sum(is_a) / 4000 - 0.25) < 0.03
  a_items = [i for i in items if i < 50]
  for e in range(len(a_items) // 50):  # source a cycles its own epochs
    assert sorted(a_items[e * 50:(e + 1) * 50]) == list(range(50))
  # Random access far ahead equals the sequential walk (a resume at a late step).
  fresh = order.Order(sizes, seed=0, weights={"a": 1.0, "b": 3.0})
  assert [fresh.item(i) for i in (3999, 10, 2500)] == [items[3999], items[10], items[2500]]


def test_resume_continues_with_the_next_prompt(data, tok):
  """A task rebuilt after a 'kill' serves prompts [k*B, ...) exactly as the uninterrupted one."""
  b, steps, kill = 8, 90, 37   # 720 prompts > 300 + 300: crosses an epoch boundary
  for weights in ("", "arith_add=1,arith_mul=2"):
    full = _task(data, tok, source_weights=weights)
    uninterrupted = [p.origin for s in range(steps) for p in full.make_problems(0, "train", s * b, b)]
    first = _task(data, tok, source_weights=weights)
    second = _task(data, tok, source_weights=weights)   # the resumed process
    resumed = ([p.origin for s in range(kill) for p in first.make_problems(0, "train", s * b, b)]
               + [p.origin for s in range(kill, steps) for p in second.make_problems(0, "train", s * b, b)])
    assert resumed == uninterrupted
    if not weights:  # the first epoch serves each prompt once
      n = full.size("train")
      assert len(set(uninterrupted[:n])) == n


def test_checkpointed_position_refuses_other_data(data, tok, tmp_path):
  t = _task(data, tok)
  state = json.loads(json.dumps(t.data_state(40)))   # as the checkpoint's JSON meta holds it
  t.check_data_state(state, 40)
  other = _task(data, tok, train_files=f"{data}/train_arith_add.jsonl")
  with pytest.raises(ConfigError, match="task.train_files.*differ from the checkpoint"):
    other.check_data_state(state, 40)


def test_long_prompts_are_dropped_and_counted_never_truncated(data, tok, capsys):
  full = _task(data, tok, limit=10_000)
  lengths = [len(full.prompt_ids(p, tok)) for p in full.make_problems(0, "train", 0, full.size("train"))]
  limit = sorted(lengths)[len(lengths) // 2]
  t = _task(data, tok, limit=limit)
  kept = t.make_problems(0, "train", 0, t.size("train"))
  assert all(len(t.prompt_ids(p, tok)) <= limit for p in kept)
  n_long = sum(n > limit for n in lengths)
  assert n_long > 0 and t.size("train") == len(lengths) - n_long
  assert t.stats()["data/train_dropped_too_long"] == n_long
  assert f"{n_long} longer than max_prompt_len={limit} tokens dropped" in capsys.readouterr().out


def test_long_prompts_follow_the_truncation_policy_and_max_samples_caps_a_split(data, tok):
  full = _task(data, tok, limit=10_000)
  problems = full.make_problems(0, "train", 0, full.size("train"))
  lengths = [len(full.prompt_ids(p, tok)) for p in problems]
  limit = sorted(lengths)[len(lengths) // 2]
  n_long = sum(n > limit for n in lengths)
  for policy in ("left", "right"):
    t = _task(data, tok, limit=limit, truncation=policy)
    assert t.size("train") == len(lengths) and t.stats()["data/train_truncated"] == n_long
    for p, n in zip(problems[:40], lengths):   # the same records in the same order: none dropped
      want = full.prompt_ids(p, tok)
      want = want if n <= limit else (want[-limit:] if policy == "left" else want[:limit])
      assert t.prompt_ids(p, tok) == want and t.prompt(p) == (full.prompt(p) if n <= limit else tok.decode(want))
  with pytest.raises(records.DataError, match=r"\.(jsonl|parquet):\d+: the prompt is \d+ tokens, longer than "
                                              f"sampler.max_prompt_len={limit}"):
    _task(data, tok, limit=limit, truncation="error")
  capped = _task(data, tok, max_train_samples=10, max_eval_samples=3)
  first = records.read_records([f"{data}/train_arith_add.jsonl"], records.Fields(solution="extra_info.solution"))[:10]
  assert sorted(p.origin for p in capped.make_problems(0, "train", 0, 10)) == sorted(r.origin for r in first)
  assert capped.size("eval") == 3 and capped.data_state(0)["fingerprint"] != full.data_state(0)["fingerprint"]


def test_eval_interleaves_sources_and_rejects_a_too_large_eval_size(data, tok):
  assert interleave(["a", "a", "a", "b"]) == [0, 3, 1, 2]
  t = _task(data, tok)
  srcs = [p.data_source for p in t.make_problems(0, "eval", 0, 4)]
  assert srcs == ["arith_add", "arith_mul", "arith_add", "arith_mul"]
  with pytest.raises(ConfigError, match="rl.eval_size"):
    t.make_problems(0, "eval", 0, t.size("eval") + 1)


def test_chat_template_rendering_equals_transformers_token_for_token(data, tok):
  transformers = need("transformers")
  hf = transformers.AutoTokenizer.from_pretrained(os.path.join(data, "tokenizer"))
  t = _task(data, tok)
  for p in t.make_problems(0, "train", 0, 6) + t.make_problems(0, "eval", 0, 4):
    want = hf.apply_chat_template(p.messages, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
    assert t.prompt_ids(p, tok) == list(want)
    assert t.prompt(p) == hf.apply_chat_template(p.messages, add_generation_prompt=True, tokenize=False)
  # enable_thinking reaches the template (an empty think block when off), as in transformers.
  off = _task(data, tok, limit=10_000, enable_thinking="off")
  p = off.make_problems(0, "train", 0, 1)[0]
  want = hf.apply_chat_template(p.messages, add_generation_prompt=True, tokenize=False, enable_thinking=False)
  assert off.prompt(p) == want and want.endswith("<think>\n\n</think>\n\n")


def test_messages_need_a_chat_template(data):
  from rl_jax.tasks.tokenizer import CharTokenizer
  with pytest.raises(ConfigError, match="no chat template"):
    _task(data, CharTokenizer())


def test_sources_share_the_batch_by_weight(data, tok):
  t = _task(data, tok, source_weights="arith_add=3,arith_mul=1")
  counts = collections.Counter(p.data_source for p in t.make_problems(0, "train", 0, 800))
  assert abs(counts["arith_add"] / 800 - 0.75) < 0.05
  with pytest.raises(ConfigError, match="source_weights.*no source 'nope'"):
    _task(data, tok, source_weights="nope=1")


def test_per_source_metrics_split_the_batch_by_source():
  import numpy as np
  from rl_jax.rl import source_metrics as sm
  srcs = ["a", "a", "b", "b", "a", "open/ai"]
  rewards = np.array([1.0, 0.0, 1.0, 1.0, 0.5, 0.0])
  lengths = np.array([4, 8, 8, 2, 6, 8])
  last = np.array([2, 9, 2, 2, 2, 7])   # eos id 2; rows at length 8 not ending in eos are truncated
  trunc = sm.truncated(lengths, last, 8, eos_id=2)
  assert trunc.tolist() == [False, True, False, False, False, True]
  m = sm.train_metrics(srcs, rewards, ["", "wrong_value", "", "", "wrong_value", "timeout"], lengths, trunc)
  assert m["train/a/reward"] == 0.5 and m["train/a/accuracy"] == 1 / 3 and m["train/a/response_length"] == 6
  assert m["train/a/truncated"] == 1 / 3 and m["train/a/share"] == 0.5
  assert m["train/b/accuracy"] == 1.0 and m["train/open~2fai/truncated"] == 1.0
  assert m["verifier/wrong_value"] == 2 / 6 and m["verifier/timeout"] == 1 / 6 and m["truncated"] == 2 / 6
  e = sm.eval_metrics(["a", "b", "a"], np.array([1.0, 0.0, 0.0]), np.array([[1.0, 0.0], [0.0, 0.0], [0.0, 0.5]]),
                      np.array([[3, 5], [8, 8], [1, 1]]), np.array([[False, False], [True, True], [False, False]]))
  assert e["eval/a/accuracy"] == 0.5 and e["eval/a/avg_at_k"] == 0.375 and e["eval/a/pass_at_k"] == 0.5
  assert e["eval/a/best_at_k"] == 0.75 and e["eval/b/best_at_k"] == 0.0   # (1 + 0.5) / 2: partial credit counts
  # maj@k: the reward of the answer most samples state (a tie goes to the answer stated first; a
  # sample without one does not vote); a source whose verifier's answers are not read has none.
  keys = [["12", "13"], None, [None, "7"]]
  voted = sm.eval_metrics(["a", "b", "a"], np.zeros(3), np.array([[1.0, 0.0], [1.0, 1.0], [0.0, 0.5]]),
                          np.ones((3, 2)), np.zeros((3, 2), bool), keys)
  assert voted["eval/a/maj_at_k"] == (1.0 + 0.5) / 2 and "eval/b/maj_at_k" not in voted
  assert sm.majority_at_k(np.array([[0.0, 1.0, 1.0, 0.0]]), [["5", "6", "6", "5 "]]).tolist() == [1.0]
  assert e["eval/a/response_length"] == 2.5 and e["eval/b/truncated"] == 1.0 and e["eval/b/count"] == 1


def test_distinct_sources_never_share_a_metric_name():
  """'a/b' and 'a_b' were both 'a_b': one source's metrics overwrote the other's."""
  import numpy as np
  from rl_jax.rl import source_metrics as sm
  sources = ["a/b", "a_b", "a~2fb", "a b", "a.b", "é", "~", ""]
  names = [sm.metric_name(s) for s in sources]
  assert len(set(names)) == len(sources) and all(re.fullmatch(r"[A-Za-z0-9_.~\-]+", n) for n in names), names
  assert sm.metric_name("openai/gsm8k") == "openai~2fgsm8k" and sm.metric_name("gsm8k_main") == "gsm8k_main"
  m = sm.train_metrics(["a/b", "a_b"], np.array([1.0, 0.0]), ["", ""], np.array([3, 3]), np.array([False, False]))
  assert m["train/a~2fb/reward"] == 1.0 and m["train/a_b/reward"] == 0.0


def _user_files(tmp):
  """A hand-written verl-schema dataset as a user brings one: two sources, chat-message prompts, a
  jsonl file and a parquet file whose reward_model is JSON text and whose prompt is a list column."""
  def row(source, question, answer, i):
    return {"data_source": source, "prompt": [{"role": "user", "content": f"{question} Put the answer in \\boxed{{}}."}],
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": "train", "index": i}}
  gsm = [row("openai/gsm8k", f"Tom has {i} apples and buys {i + 3} more. How many now?", str(2 * i + 3), i)
         for i in range(12)]
  mth = [row("lighteval/MATH", f"What is ${i}^2$?", str(i * i), i) for i in range(12)]
  records.write_jsonl(str(tmp / "train.jsonl"), gsm[:8] + mth[:8])
  records.write_parquet(str(tmp / "eval.parquet"),
                        [dict(r, reward_model=json.dumps(r["reward_model"])) for r in gsm[8:] + mth[8:]])
  return str(tmp / "train.jsonl"), str(tmp / "eval.parquet")


def test_the_math_config_takes_a_users_files_with_two_keys(data, tmp_path):
  """configs/math_tiny.py with only task.train_files / task.eval_files set passes every check its
  run makes before compute (the demo's solution_key, source_weights and 64-token prompts once failed
  here). The tokenizer is the one `python -m rl_jax.tasks.arith` writes, here under the test's data."""
  from rl_jax.configs import math_tiny
  from rl_jax.rl.job import RLJob
  from rl_jax.rl.warm_start import check_sft_section
  cfg = math_tiny.get_config()
  cfg.task.train_files, cfg.task.eval_files = _user_files(tmp_path)
  cfg.task.overrides.tokenizer = cfg.task.overrides.tokenizer.replace(math_tiny.DATA, data)
  job = RLJob.from_config(cfg)
  task = task_build.make_task(job.task)
  tok = task_build.make_tokenizer(task, job.model)
  task_build.bind_task(task, tok, job.sampler.max_prompt_len)
  job.check_data(task, tok)
  check_sft_section(cfg, task, tok)
  assert task.size("train") == 16 and task.size("eval") == 8 and task.stats()["data/train_dropped_too_long"] == 0
  assert [p.data_source for p in task.make_problems(0, "eval", 0, 2)] == ["openai/gsm8k", "lighteval/MATH"]
  assert task.verifier_of("openai/gsm8k") == "gsm8k" and task.verifier_of("lighteval/MATH") == "math"   # verl's
  assert task.completion(task.make_problems(0, "eval", 0, 1)[0]) == "The answer is\n#### 19"


def test_eval_files_are_optional(data, tmp_path):
  """Without task.eval_files a run trains only: the checks pass, preview shows the train prompts,
  and asking for eval prompts names the key."""
  import io
  from rl_jax.configs import math_tiny
  from rl_jax.rl.job import RLJob
  from rl_jax.tasks.__main__ import preview
  cfg = math_tiny.get_config("test")
  cfg.task.train_files, _ = _user_files(tmp_path)
  cfg.task.overrides.tokenizer = f"{data}/tokenizer"
  cfg.task.overrides.verifiers = "*=exact_match"   # in-process verifiers: no worker to start here
  job = RLJob.from_config(cfg)
  task = task_build.make_task(job.task)
  tok = task_build.make_tokenizer(task, job.model)
  task_build.bind_task(task, tok, job.sampler.max_prompt_len)
  job.check_data(task, tok)
  assert not task_build.has_eval(task) and task_build.has_eval(get_task("countdown_easy"))
  assert task.data_state(8)["eval_fingerprint"] is None and set(task.stats()) == {
      "data/train_prompts", "data/train_dropped_too_long", "data/train_truncated"}
  with pytest.raises(ConfigError, match="task.eval_files': empty, so there are no eval prompts"):
    task.make_problems(0, "eval", 0, 1)
  rows = preview(cfg, 2, out=io.StringIO())
  assert [(r["split"], r["reward"]) for r in rows] == [("train", 1.0), ("train", 1.0)]


def _preview_config(data, train_files, **overrides):
  from rl_jax.configs import math_tiny
  cfg = math_tiny.get_config("test")
  cfg.task.train_files = train_files
  cfg.task.eval_files = f"{data}/eval_arith_add.jsonl"
  cfg.task.overrides.tokenizer = f"{data}/tokenizer"
  cfg.task.overrides.update(overrides)
  return cfg


def _bad_inputs(tmp, data):
  """(case, train_files, task.overrides, the error line) of each broken input a user hits."""
  row = json.dumps({"prompt": "hi", "data_source": "s", "reward_model": {"ground_truth": "1"}})
  (tmp / "latin1.jsonl").write_bytes(row.encode() + b"\n" + row.replace("hi", "caf\xe9").encode("latin-1") + b"\n")
  good = (tmp / "good.parquet")
  records.write_parquet(str(good), [json.loads(row)] * 50)
  (tmp / "cut.parquet").write_bytes(good.read_bytes()[:len(good.read_bytes()) // 2])
  (tmp / "empty.jsonl").write_text("")
  (tmp / "raises_on_import.py").write_text("raise RuntimeError('no GPU here')\n")
  (tmp / "bad_syntax.py").write_text("def score(:\n")
  ok = f"{data}/train_arith_add.jsonl"
  cases = [
      ("non_utf8", str(tmp / "latin1.jsonl"), {},
       f"{tmp}/latin1.jsonl:2: not UTF-8 (byte 0xe9 at column 16)"),
      ("truncated_parquet", str(tmp / "cut.parquet"), {}, f"{tmp}/cut.parquet: not a readable parquet file ("),
      ("empty_file", str(tmp / "empty.jsonl"), {}, f"{tmp}/empty.jsonl: no rows (the file is empty)"),
      ("verifier_import_raises", ok, {"default_verifier": "raises_on_import:score"},
       "config key 'task.overrides.default_verifier': cannot load verifier 'raises_on_import:score' "
       "(RuntimeError: no GPU here)"),
      ("verifier_syntax_error", ok, {"verifiers": "arith_*=bad_syntax:score"},
       "config key 'task.overrides.verifiers': cannot load verifier 'bad_syntax:score' (SyntaxError: "),
  ]
  try:
    import gcsfs  # noqa: F401  # pylint: disable=unused-import
  except ImportError:
    cases.append(("gs_without_gcsfs", "gs://bucket/train.jsonl", {},
                  "config key 'task.train_files': reading gs:// files needs gcsfs: pip install 'rl_jax[gcs]'"))
  return cases


def test_preview_prints_one_line_for_every_bad_input(data, tmp_path, monkeypatch, capsys):
  """Each broken input a user hits is one line 'config error: ...' (exit 2) naming the file and
  line or the key, as `python -m rl_jax.main` prints it (test_main_prints_the_previews_line)."""
  from rl_jax import cli
  from rl_jax.tasks.__main__ import run_preview
  monkeypatch.delenv(cli.TRACEBACK_ENV, raising=False)
  monkeypatch.syspath_prepend(str(tmp_path))
  for case, files, overrides, line in _bad_inputs(tmp_path, data):
    with pytest.raises(SystemExit) as e:
      run_preview(_preview_config(data, files, **overrides), 1)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("config error: " + line), (case, err)


@pytest.mark.slow  # ~10 s: a process importing jax
def test_main_prints_the_previews_line(data, tmp_path, capsys):
  import subprocess
  import sys
  from rl_jax.tasks.__main__ import run_preview
  case, files, _, _ = _bad_inputs(tmp_path, data)[0]
  with pytest.raises(SystemExit):
    run_preview(_preview_config(data, files), 1)
  line = capsys.readouterr().err
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  r = subprocess.run([sys.executable, "-m", "rl_jax.main", "--config=configs/math_tiny.py:test",
                      f"--workdir={tmp_path}/run", f"--config.task.train_files={files}",
                      f"--config.task.eval_files={data}/eval_arith_add.jsonl",
                      f"--config.task.overrides.tokenizer={data}/tokenizer"], cwd=repo, capture_output=True,
                     text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu", RL_JAX_TRACEBACK=""))
  assert r.returncode == 2 and r.stderr == line, (case, r.stderr[-3000:])


def test_preview_renders_prompts_and_accepts_the_reference_answers(data):
  import io
  from rl_jax.configs import math_tiny
  from rl_jax.tasks.__main__ import preview
  cfg = math_tiny.get_config("test")
  cfg.task.train_files = f"{data}/train_arith_add.jsonl,{data}/train_arith_mul.parquet"
  cfg.task.eval_files = f"{data}/eval_arith_add.parquet,{data}/eval_arith_mul.jsonl"
  cfg.task.overrides.tokenizer = f"{data}/tokenizer"
  out = io.StringIO()
  rows = preview(cfg, 2, out=out)
  assert [(r["split"], r["index"]) for r in rows] == [("train", 0), ("train", 1), ("eval", 0), ("eval", 1)]
  assert all(r["reward"] == 1.0 and r["verifier"] == "math" for r in rows), rows
  assert [r["source"] for r in rows[2:]] == ["arith_add", "arith_mul"]
  text = out.getvalue()
  assert "<|im_start|>assistant\n" in text and "verdict on the reference: reward 1.0" in text
