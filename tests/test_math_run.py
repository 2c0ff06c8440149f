"""The math path end to end (generated jsonl + parquet, two sources: RL, per-source metrics, resume); its configs."""
import json
import math

import jax
import numpy as np
import pytest
from conftest import run_clean_and_killed

from rl_jax.config_utils import ConfigError
from rl_jax.configs import math_tiny
from rl_jax.configs import qwen3_30b_a3b_math
from rl_jax.configs import qwen3_30b_a3b_minirl
from rl_jax.rl import trainer as trainer_lib
from rl_jax.rl.trainer import RLJob
from rl_jax.tasks import arith, get_task
from rl_jax.tasks.dataset import DatasetTask
from rl_jax.tasks.hf_tokenizer import HFTokenizer


@pytest.fixture(scope="module")
def data(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("math"))
  arith.write(out, train=200, eval_count=16)
  return out


def _config(data, **overrides):
  cfg = math_tiny.get_config("test")
  cfg.task.train_files = f"{data}/train_arith_add.jsonl,{data}/train_arith_mul.parquet"
  cfg.task.eval_files = f"{data}/eval_arith_add.parquet,{data}/eval_arith_mul.jsonl"
  cfg.task.overrides.tokenizer = f"{data}/tokenizer"
  cfg.warm_start.source = "none"   # the SFT warm start is the SFT job's test; RL from init here
  for k, v in overrides.items():
    node = cfg
    *path, last = k.split(".")
    for p in path:
      node = node[p]
    node[last] = v
  return cfg


@pytest.mark.slow  # ~2 minutes on 2 shared cores: two trainers' compilations
def test_math_run_trains_evaluates_per_source_and_resumes_without_repeating(tmp_path, data, monkeypatch):
  b = 4
  served = []
  make = DatasetTask.make_problems

  def recording(self, seed, split, start, count):
    out = make(self, seed, split, start, count)
    if split == "train" and count == b:   # a step's prompts (not the up-front length check)
      served.append((start, [p.origin for p in out]))
    return out
  monkeypatch.setattr(DatasetTask, "make_problems", recording)
  workdir = str(tmp_path / "run")
  trainer_lib.run(_config(data, **{"rl.steps": 2, "rl.prompts_per_step": b}), workdir)
  # Killed after step 2's checkpoint; the restarted process runs on to step 4.
  trainer_lib.run(_config(data, **{"rl.steps": 4, "rl.prompts_per_step": b}), workdir)
  reference = get_task("dataset", dict(_config(data).task.overrides, train_files=_config(data).task.train_files,
                                       eval_files=_config(data).task.eval_files))
  reference.bind(HFTokenizer.from_dir(f"{data}/tokenizer"), _config(data).sampler.max_prompt_len)
  want = [p.origin for p in reference.make_problems(0, "train", 0, 4 * b)]
  assert [s for s, _ in served] == [0, b, 2 * b, 3 * b]
  assert [o for _, origins in served for o in origins] == want   # no prompt repeated or skipped
  rows = [json.loads(line) for line in open(f"{workdir}/metrics.jsonl")]
  assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
  for r in rows[1:]:
    assert any(k.startswith("train/arith_") for k in r) and math.isfinite(r["loss/loss"] if "loss/loss" in r
                                                                          else r["reward"])
    assert r["data/train_prompts"] == 400 and r["data/epoch"] == r["step"] * b / 400
    assert r["data/consumed"] == r["step"] * b
  for r in (rows[0], rows[-1]):   # evaluated per source at the start and the end
    for s in arith.SOURCES:
      for m in ("accuracy", "avg_at_k", "pass_at_k", "best_at_k", "maj_at_k", "response_length", "truncated"):
        assert math.isfinite(r[f"eval/{s}/{m}"]), (s, m)
      assert r[f"eval/{s}/count"] == 4
  ckpt_meta = json.loads(open(f"{workdir}/checkpoints/4/meta/metadata").read())
  assert ckpt_meta["data"]["consumed"] == 4 * b


@pytest.mark.slow  # ~3 minutes on 2 cores: three processes' compilations
def test_math_run_killed_with_sigkill_resumes_to_the_uninterrupted_params(tmp_path, data):
  """`python -m rl_jax.main` on the dataset task, killed with SIGKILL after step 2's checkpoint and
  rerun, ends with the parameters and data position of an uninterrupted run: no prompt trained twice
  or skipped (a different prompt order would move the parameters)."""
  def cmd(workdir):
    return ["-m", "rl_jax.main", "--config=configs/math_tiny.py:test", f"--workdir={workdir}",
            "--config.warm_start.source=none", "--config.rl.steps=5", "--config.rl.eval_every=5",
            f"--config.task.train_files={data}/train_arith_add.jsonl,{data}/train_arith_mul.parquet",
            f"--config.task.eval_files={data}/eval_arith_add.parquet,{data}/eval_arith_mul.jsonl",
            f"--config.task.overrides.tokenizer={data}/tokenizer"]
  clean, killed = tmp_path / "clean", tmp_path / "killed"
  run_clean_and_killed(cmd, clean, killed, kill_after=2, last=5)
  metas = [json.loads((w / "checkpoints" / "5" / "meta" / "metadata").read_text()) for w in (clean, killed)]
  assert metas[0]["data"] == metas[1]["data"] and metas[1]["data"]["consumed"] == 5 * 4
  steps = [json.loads(line)["step"] for line in open(killed / "metrics.jsonl")]
  assert sorted(set(steps)) == [0, 1, 2, 3, 4, 5]
  # The subprocesses ran on one device; this process has 8: 'force' accepts the layout change.
  cfg = _config(data, **{"rl.steps": 5, "resume": "force"})
  with trainer_lib.RLTrainer(cfg, str(clean)) as a, trainer_lib.RLTrainer(cfg, str(killed)) as b:
    assert a.start_step == b.start_step == 5
    for x, y in zip(jax.tree.leaves(a.state["params"]), jax.tree.leaves(b.state["params"])):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_math_configs_validate_and_state_their_recipes():
  for arg in (None, "test", "demo"):
    cfg = math_tiny.get_config(arg)
    RLJob.from_config(cfg)
    get_task("dataset", dict(cfg.task.overrides, train_files=cfg.task.train_files))  # keys and verifiers
  sc = RLJob.from_config(qwen3_30b_a3b_math.get_config())
  assert (sc.rl.prompts_per_step, sc.rl.group_size, sc.sampler.max_new_tokens) == (16, 8, 1024)
  assert (sc.optim.name, sc.optim.lr, sc.optim.schedule) == ("sgd", 1e-2, "constant")
  assert (sc.advantage.mode, sc.advantage.reward_mode) == ("group_centered", "pm1")
  assert sc.loss.score_centering == "topk" and sc.task.name == "dataset" and not sc.task.train_files
  for n in qwen3_30b_a3b_minirl.N_CHOICES:
    mine = RLJob.from_config(qwen3_30b_a3b_math.get_config(f"minirl_n{n}"))
    ref = RLJob.from_config(qwen3_30b_a3b_minirl.get_config(f"n{n}"))
    assert (mine.rl, mine.loss, mine.optim, mine.sampler, mine.mesh) == (ref.rl, ref.loss, ref.optim, ref.sampler,
                                                                         ref.mesh)
  cfg = qwen3_30b_a3b_math.get_config()
  get_task("dataset", dict(cfg.task.overrides))
  with pytest.raises(ValueError, match="unknown config arg"):
    qwen3_30b_a3b_math.get_config("minirl_n3")


def test_overlong_buffer_is_checked_against_the_sampler():
  cfg = math_tiny.get_config("test")
  cfg.rl.overlong_buffer = cfg.sampler.max_new_tokens + 1
  with pytest.raises(ConfigError, match="rl.overlong_buffer.*exceeds sampler.max_new_tokens"):
    RLJob.from_config(cfg)
  cfg.rl.overlong_buffer = -1
  with pytest.raises(ConfigError, match="rl.overlong_buffer': must be >= 0"):
    RLJob.from_config(cfg)
