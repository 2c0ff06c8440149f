"""`python -m rl_jax.tasks preview --config=CONFIG [--n 3]`: what the model will see, before any compute.

Prints, for the first n train and eval prompts of the config's task: the rendered prompt with its
special tokens, its token count, the data source and the verifier it maps to, the ground truth,
and the verifier's verdict on the reference answer (the SFT target) — a wrong verdict there is a
schema or verifier mistake, cheaper to find here than after a GPU hour.
"""
from __future__ import annotations

import sys

from absl import app, flags
from ml_collections import config_flags

from rl_jax import cli
from rl_jax import data as data_lib
from rl_jax.config_utils import ConfigError, from_dict
from rl_jax.models import ModelConfig
from rl_jax.tasks import build as task_build
from rl_jax.tasks.hf_tokenizer import HFTokenizer

_CONFIG = config_flags.DEFINE_config_file("config", None, "a job config (configs/*.py[:arg])", lock_config=False)
_N = flags.DEFINE_integer("n", 3, "prompts per split")


def preview(config, n: int, out=sys.stdout) -> list[dict]:
  """Renders and verifies the first n prompts of each split; returns one dict per prompt."""
  task_cfg = from_dict(task_build.TaskConfig, config.task, prefix="task")
  task = task_build.make_task(task_cfg)
  model = config.model
  ws = config.get("warm_start", {})
  if ws and ws.get("source") == "hf" and ws.get("path"):
    tok = HFTokenizer.from_dir(ws.path)
  else:
    tok = task_build.make_tokenizer(task, from_dict(ModelConfig, model, prefix="model"))
  limit = config.sampler.max_prompt_len if "sampler" in config else config.sft.max_len
  task_build.bind_task(task, tok, limit)
  rows = []
  try:
    for split in ("train", "eval") if task_build.has_eval(task) else ("train",):
      for i, p in enumerate(task.make_problems(config.get("seed", 0), split, 0, n)):
        ids = data_lib.prompt_ids(task, tok, p)
        reference = task.completion(p)
        verdict = task.reward_details(p, reference)
        row = {"split": split, "index": i, "prompt": task.prompt(p), "tokens": len(ids),
               "source": getattr(task, "source_of", lambda _: task.name)(p),
               "verifier": getattr(task, "verifier_of", lambda _: task.name)(getattr(p, "data_source", "")),
               "ground_truth": getattr(p, "ground_truth", p), "reference": reference,
               "reward": verdict.reward, "error": verdict.error or ""}
        rows.append(row)
        print(f"=== {split} #{i}  source={row['source']}  verifier={row['verifier']}  "
              f"{row['tokens']} prompt tokens (max_prompt_len {limit})", file=out)
        print(row["prompt"], file=out)
        print(f"--- ground truth: {row['ground_truth']!r}", file=out)
        print(f"--- reference answer: {reference!r}", file=out)
        print(f"--- verdict on the reference: reward {row['reward']}"
              + (f" ({row['error']})" if row["error"] else ""), file=out)
  finally:
    if hasattr(task, "close"):
      task.close()
  return rows


def main(argv):
  if len(argv) != 2 or argv[1] != "preview":
    raise app.UsageError("usage: python -m rl_jax.tasks preview --config=CONFIG [--n 3]")
  run_preview(_CONFIG.value, _N.value)


def run_preview(config, n: int) -> None:
  """`preview`, with a data or config error printed as `python -m rl_jax.main` prints it: one line
  'config error: ...' on stderr and exit code 2 (RL_JAX_TRACEBACK=1 adds the traceback)."""
  try:
    preview(config, n)
  except ConfigError as e:
    cli.fail(cli.CONFIG_ERROR, f"config error: {e}")


if __name__ == "__main__":
  app.run(main)
