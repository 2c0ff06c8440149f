"""A generated math dataset for tests and the demo: arithmetic word problems in verl's schema, and a tokenizer for them.

    python -m rl_jax.tasks.arith --out /tmp/rl_jax_math [--train 2000 --eval 128]

writes, per source (`arith_add`: two steps of + and -, `arith_mul`: three steps with a
product), train_<source>.jsonl / .parquet and eval_<source>.jsonl / .parquet, and tokenizer/:
a byte-level BPE trained on the problems with the `tokenizers` trainer, a ChatML-style chat
template (with Qwen3's enable_thinking switch) and tokenizer_config.json, loadable by
rl_jax.tasks.hf_tokenizer.HFTokenizer and by transformers' AutoTokenizer alike.
Everything is a pure function of (seed, split, index): the same command writes the same files.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os

from rl_jax.tasks import records

SOURCES = ("arith_add", "arith_mul")
PAD, IM_START, IM_END, EOT = "<|pad|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"
SPECIALS = (PAD, IM_START, IM_END, EOT)  # ids 0..3: pad 0, eos (<|im_end|>) 2
VOCAB_SIZE = 384
SYSTEM = "Solve it. Put the answer in \\boxed{}."
_NAMES = ("Ann", "Bob", "Cy", "Dee", "Eve", "Fay", "Gus", "Hal")
_ITEMS = ("pens", "cups", "eggs", "books", "coins", "nuts")

# ChatML as Qwen renders it; `enable_thinking=false` prefills an empty think block (Qwen3's switch).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}")


class _Rng:
  """Integers from a hash of (seed, split, source, index, counter): stable across library versions."""

  def __init__(self, *key):
    self._key = "/".join(map(str, ("rl_jax.arith/v1",) + key)).encode()
    self._n = 0

  def below(self, n: int) -> int:
    h = hashlib.blake2b(self._key + b"/%d" % self._n, digest_size=8).digest()
    self._n += 1
    return int.from_bytes(h, "little") % n

  def between(self, lo: int, hi: int) -> int:
    return lo + self.below(hi - lo + 1)


def problem(source: str, seed: int, split: str, index: int) -> dict:
  """One row in verl's schema: prompt (chat messages), data_source, reward_model, extra_info."""
  r = _Rng(seed, split, source, index)
  who, item = _NAMES[r.below(len(_NAMES))], _ITEMS[r.below(len(_ITEMS))]
  if source == "arith_add":
    a, b = r.between(2, 20), r.between(2, 20)
    c = r.between(1, a + b - 1)
    text = f"{who} has {a} {item}, gets {b} more, then gives away {c}. How many {item} now?"
    steps = [f"{a}+{b}={a + b}", f"{a + b}-{c}={a + b - c}"]
    answer = a + b - c
  elif source == "arith_mul":
    n, k, extra = r.between(2, 6), r.between(2, 9), r.between(1, 9)
    c = r.between(1, n * k + extra - 1)
    text = (f"{who} has {n} bags of {k} {item} and {extra} loose {item}, then gives away {c}. "
            f"How many {item} now?")
    steps = [f"{n}*{k}={n * k}", f"{n * k}+{extra}={n * k + extra}", f"{n * k + extra}-{c}={n * k + extra - c}"]
    answer = n * k + extra - c
  else:
    raise ValueError(f"unknown source {source!r}; valid: {list(SOURCES)}")
  solution = ". ".join(steps) + f". \\boxed{{{answer}}}"
  return {"data_source": source,
          "prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}],
          "ability": "math",
          "reward_model": {"style": "rule", "ground_truth": str(answer)},
          "extra_info": {"split": split, "index": index, "solution": solution}}


def rows(source: str, seed: int, split: str, count: int) -> list[dict]:
  return [problem(source, seed, split, i) for i in range(count)]


def train_tokenizer(texts, out_dir: str, vocab_size: int = VOCAB_SIZE) -> str:
  """A byte-level BPE trained on `texts`, its chat template and config, written to `out_dir`."""
  import tokenizers  # pylint: disable=g-import-not-at-top
  from tokenizers import decoders, models, pre_tokenizers, trainers  # pylint: disable=g-import-not-at-top
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS), show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(texts, trainer)
  os.makedirs(out_dir, exist_ok=True)
  tok.save(os.path.join(out_dir, "tokenizer.json"))
  config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": IM_END, "pad_token": PAD,
            "bos_token": None, "unk_token": None, "chat_template": CHAT_TEMPLATE,
            "model_max_length": 4096, "clean_up_tokenization_spaces": False}
  with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
    json.dump(config, f, indent=1)
  return out_dir


def _corpus(data: dict) -> list[str]:
  """Texts the tokenizer learns its merges from: every message and solution, as rendered."""
  out = []
  for rs in data.values():
    for row in rs:
      out += [m["content"] for m in row["prompt"]] + [row["extra_info"]["solution"]]
  return out + ["<think>\n\n</think>\n\n", "user\n", "assistant\n", "system\n"]


def write(out: str, train: int = 2000, eval_count: int = 128, seed: int = 0) -> dict:
  """Writes both sources' splits as jsonl and parquet, and the tokenizer; returns the paths."""
  os.makedirs(out, exist_ok=True)
  data = {(s, split): rows(s, seed, split, n) for s in SOURCES
          for split, n in (("train", train), ("eval", eval_count))}
  # Distinct splits: an eval problem that also appears in train is dropped from eval.
  seen = {json.dumps(r["prompt"]) for s in SOURCES for r in data[(s, "train")]}
  for s in SOURCES:
    data[(s, "eval")] = [r for r in data[(s, "eval")] if json.dumps(r["prompt"]) not in seen]
  paths = {}
  for (s, split), rs in data.items():
    for ext, fn in (("jsonl", records.write_jsonl), ("parquet", records.write_parquet)):
      p = os.path.join(out, f"{split}_{s}.{ext}")
      fn(p, rs)
      paths[f"{split}_{s}.{ext}"] = p
  paths["tokenizer"] = train_tokenizer(_corpus(data), os.path.join(out, "tokenizer"))
  return paths


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--out", required=True)
  ap.add_argument("--train", type=int, default=2000, help="train problems per source")
  ap.add_argument("--eval", type=int, default=128, help="eval problems per source (before dedup)")
  ap.add_argument("--seed", type=int, default=0)
  a = ap.parse_args(argv)
  paths = write(a.out, a.train, a.eval, a.seed)
  print("\n".join(f"{k}: {v}" for k, v in sorted(paths.items())))


if __name__ == "__main__":
  main()
