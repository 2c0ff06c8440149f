"""The dataset task (`task.name=dataset`): prompts from jsonl / parquet files, shuffled, verified per source."""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
from typing import Any, Literal, Sequence

import numpy as np

from rl_jax.config_utils import ConfigError, from_dict, require
from rl_jax.tasks import order as order_lib
from rl_jax.tasks import records as records_lib
from rl_jax.tasks import sandbox
from rl_jax.tasks import verifiers as verifiers_lib
from rl_jax.tasks.base import register_task
from rl_jax.tasks.records import Record

Split = Literal["train", "eval"]
# Bumping this changes the fingerprint of every dataset (a stored run then refuses to resume).
_FINGERPRINT_VERSION = b"rl_jax.dataset/v1"


@dataclasses.dataclass(frozen=True)
class DatasetConfig:
  """Files, schema, rendering, mixing and verification of the dataset task (`task.overrides.*`).

  train_files / eval_files: comma-separated paths or globs (local, gs://, s3://), .jsonl or
    .parquet; set through `task.train_files` / `task.eval_files` (eval files are optional).
  prompt_key ... solution_key: dotted paths of a row's fields (verl's schema by default);
    `default_source` names the source of rows without one (or of every row if source_key='').
  chat_template: chat-message prompts go through the tokenizer's chat template with
    add_generation_prompt; `string_prompts='chat'` wraps string prompts as one user message too
    ('raw': a string prompt is the text itself, after bos). `system_prompt` (non-empty) is
    prepended as a system message to prompts that have none. `enable_thinking` 'on' / 'off'
    passes enable_thinking=True / False to templates that read it (Qwen3); 'default' passes none.
  truncation: a rendered prompt longer than max_prompt_len is 'drop'ped (counted), cut to its
    last ('left') or first ('right') max_prompt_len tokens (counted), or an 'error' naming its row.
  max_train_samples / max_eval_samples: only the first N rows of a split's files (0: all).
  tokenizer: a directory with tokenizer.json (+ tokenizer_config.json or chat_template.jinja)
    for a run that does not start from an HF checkpoint (whose own tokenizer wins otherwise).
  source_weights: 'source=w,...' samples train prompts per source with these weights (each
    source its own epochs; unnamed sources get weight 0); empty pools every source and shuffles.
  verifiers: 'pattern=verifier,...' (fnmatch patterns on data_source, first match wins; a
    verifier is a registered name or 'module:function'), then (`verl_scorers`) verl's scorer of
    the sources it names (verifiers.VERL_SOURCES: openai/gsm8k -> gsm8k, the MATH sets -> math,
    math_dapo / aime* -> dapo_math), else `default_verifier`.
  boxed: which \\boxed{} answers of a completion the built-in verifiers grade: 'last' (verl's
    rule), 'any' or 'all'.
  max_verifier_failures: the share of one verifier's calls in a batch that may raise (or return
    no number) before the run stops with the exception's text and the row (0 stops at the first).
  verifier_workers / verifier_timeout_s / verifier_memory_mb: the sandbox of isolated verifiers.
  """
  train_files: str = ""
  eval_files: str = ""
  prompt_key: str = "prompt"
  source_key: str = "data_source"
  answer_key: str = "reward_model.ground_truth"
  extra_key: str = "extra_info"
  solution_key: str = ""
  default_source: str = ""
  chat_template: bool = True
  string_prompts: Literal["raw", "chat"] = "raw"
  system_prompt: str = ""
  enable_thinking: Literal["default", "on", "off"] = "default"
  tokenizer: str = ""
  truncation: Literal["drop", "left", "right", "error"] = "drop"
  max_train_samples: int = 0
  max_eval_samples: int = 0
  shuffle: bool = True
  source_weights: str = ""
  verifiers: str = ""
  default_verifier: str = "math"
  verl_scorers: bool = True
  boxed: Literal["last", "any", "all"] = "last"
  max_verifier_failures: float = 0.5
  verifier_workers: int = 2
  verifier_timeout_s: float = 5.0
  verifier_memory_mb: int = 2048

  def __post_init__(self):
    k = "task.overrides."
    require(self.string_prompts in ("raw", "chat"), k + "string_prompts",
            f"{self.string_prompts!r} is not one of ['raw', 'chat']")
    require(self.enable_thinking in ("default", "on", "off"), k + "enable_thinking",
            f"{self.enable_thinking!r} is not one of ['default', 'on', 'off']")
    require(self.boxed in verifiers_lib.BOX_POLICIES, k + "boxed",
            f"{self.boxed!r} is not one of {list(verifiers_lib.BOX_POLICIES)}")
    require(0.0 <= self.max_verifier_failures <= 1.0, k + "max_verifier_failures",
            f"must be in [0, 1], got {self.max_verifier_failures}")
    require(self.truncation in ("drop", "left", "right", "error"), k + "truncation",
            f"{self.truncation!r} is not one of ['drop', 'left', 'right', 'error']")
    for key in ("max_train_samples", "max_eval_samples"):
      require(getattr(self, key) >= 0, k + key, f"must be >= 0 (0: every row), got {getattr(self, key)}")
    require(self.verifier_workers >= 1, k + "verifier_workers", f"must be >= 1, got {self.verifier_workers}")
    require(self.verifier_timeout_s > 0, k + "verifier_timeout_s", f"must be > 0, got {self.verifier_timeout_s}")
    require(self.verifier_memory_mb >= 256, k + "verifier_memory_mb",
            f"must be >= 256 (a worker imports sympy), got {self.verifier_memory_mb}")
    verifiers_lib.check_spec(self.default_verifier, k + "default_verifier")
    verifiers_lib.parse_map(self.verifiers, k + "verifiers")

  @property
  def fields(self) -> records_lib.Fields:
    return records_lib.Fields(prompt=self.prompt_key, source=self.source_key, answer=self.answer_key,
                              extra=self.extra_key, solution=self.solution_key,
                              default_source=self.default_source)


@dataclasses.dataclass(frozen=True)
class Verdict:
  """What a verifier said about one completion (the RewardInfo protocol); `detail` is the text of
  the exception it raised, if it did."""
  reward: float
  error: str
  detail: str = ""


class VerifierError(ConfigError):
  """A verifier failed on more than task.overrides.max_verifier_failures of a batch's calls: a
  broken verifier (e.g. another signature), not a hostile completion; the run stops."""


# The errors that are the verifier's own failure; a timeout or a memory cap is the completion's.
_VERIFIER_FAILURES = (sandbox.EXCEPTION, sandbox.BAD_RESULT)


@dataclasses.dataclass
class _Split:
  records: list[Record]
  ids: list[np.ndarray]
  texts: list[str]
  files: list[str]
  dropped: collections.Counter  # source -> prompts longer than max_prompt_len
  fingerprint: str
  truncated: int = 0  # prompts cut to max_prompt_len (truncation 'left' / 'right')
  pos: dict | None = None  # record -> index, built on first lookup


class DatasetTask:
  """Prompts read from files; implements rl_jax.tasks.base.Task once bound to a tokenizer.

  `bind(tokenizer, max_prompt_len)` (the jobs call it right after building the tokenizer) reads
  the files, renders each prompt, tokenizes it and drops, counting them, the prompts longer than
  `max_prompt_len`; problems are the kept Records.
  """
  name = "dataset"

  def __init__(self, config: DatasetConfig):
    self.config = config
    self._rules = verifiers_lib.parse_map(config.verifiers, "task.overrides.verifiers")
    if config.verl_scorers:
      self._rules += list(verifiers_lib.VERL_SOURCES)
    self._splits: dict[str, _Split] = {}
    self._bound = None
    self._orders: dict[int, order_lib.Order] = {}
    self._pool: sandbox.Pool | None = None

  @property
  def tokenizer_path(self) -> str:
    return self.config.tokenizer

  @property
  def has_eval(self) -> bool:
    """Whether the task has eval prompts (task.eval_files set); without, a run trains only."""
    return bool(self.config.eval_files)

  # -- loading ----------------------------------------------------------------------------------

  def bind(self, tok: Any, max_prompt_len: int) -> None:
    """Reads, renders, tokenizes and filters both splits (once per tokenizer and limit)."""
    if self._bound == (id(tok), max_prompt_len):
      return
    require(bool(self.config.train_files), "task.train_files",
            "empty: the dataset task needs its train files (--config.task.train_files=PATH_OR_GLOB)")
    self._splits = {}
    for split, key in (("train", "task.train_files"), ("eval", "task.eval_files")):
      if split == "eval" and not self.has_eval:   # eval files are optional: a run then never evaluates
        continue
      files = records_lib.expand(getattr(self.config, split + "_files"), key)
      self._splits[split] = self._load(split, files, tok, max_prompt_len)
    self._bound = (id(tok), max_prompt_len)
    self._eval_order = interleave([r.data_source for r in self._splits["eval"].records]) if self.has_eval else []
    self._orders = {}
    # Sources are those with kept prompts: a weighted source whose prompts were all dropped is named.
    self._weights = order_lib.parse_weights(self.config.source_weights, self.sources("train"),
                                            "task.overrides.source_weights")

  def _render(self, rec: Record, tok: Any) -> tuple[str, list[int]]:
    cfg = self.config
    chat = not isinstance(rec.prompt, str) or cfg.string_prompts == "chat"
    if not chat or not cfg.chat_template:
      text = rec.prompt if isinstance(rec.prompt, str) else "\n".join(c for _, c in rec.prompt)
      return text, [tok.bos_id] + tok.encode(text)
    if not hasattr(tok, "apply_chat_template") or getattr(tok, "chat_template", None) is None:
      raise ConfigError(f"{rec.origin}: the prompt is a list of chat messages but the tokenizer has no "
                        "chat template (give task.overrides.tokenizer a directory with one, or set "
                        "task.overrides.chat_template=False to join the messages as plain text)")
    messages = rec.messages
    if cfg.system_prompt and messages[0]["role"] != "system":
      messages = [{"role": "system", "content": cfg.system_prompt}] + messages
    kwargs = {} if cfg.enable_thinking == "default" else {"enable_thinking": cfg.enable_thinking == "on"}
    try:
      text = tok.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
    except Exception as e:  # pylint: disable=broad-except
      raise records_lib.DataError(f"{rec.origin}: the chat template failed on this prompt ({e})") from e
    return text, tok.encode(text)

  def _load(self, split: str, files: list[str], tok: Any, limit: int) -> _Split:
    recs, ids, texts, dropped, truncated = [], [], [], collections.Counter(), 0
    h = hashlib.blake2b(_FINGERPRINT_VERSION, digest_size=16)
    policy = self.config.truncation
    rows = records_lib.read_records(files, self.config.fields)
    cap = getattr(self.config, f"max_{split}_samples")
    for rec in rows[:cap] if cap else rows:
      text, row = self._render(rec, tok)
      if len(row) > limit:
        if policy == "drop":
          dropped[rec.data_source] += 1
          continue
        if policy == "error":
          raise records_lib.DataError(
              f"{rec.origin}: the prompt is {len(row)} tokens, longer than sampler.max_prompt_len={limit} "
              "(task.overrides.truncation='error'; 'drop', 'left' or 'right' keep the run going)")
        row = row[-limit:] if policy == "left" else row[:limit]
        text = tok.decode(row)   # what the model sees, for preview and the fingerprint
        truncated += 1
      recs.append(rec)
      ids.append(np.asarray(row, np.int32))   # 4 bytes a token, not a Python int
      texts.append(text)
      h.update(json.dumps([rec.data_source, text, rec.ground_truth_json]).encode() + b"\n")
    n_drop = sum(dropped.values())
    by_source = collections.Counter(r.data_source for r in recs)
    print(f"[data] {split}: {len(recs)} prompts from {len(files)} file(s) "
          f"({', '.join(f'{s} {n}' for s, n in sorted(by_source.items()))}); {n_drop} longer than "
          f"max_prompt_len={limit} tokens dropped" + (f" ({dict(dropped)})" if n_drop else "")
          + (f", {truncated} cut to it ({policy})" if truncated else ""))
    if not recs:
      raise ConfigError(f"config key 'task.{split}_files': no prompt of {files} fits max_prompt_len={limit} "
                        f"({n_drop} dropped as longer)")
    return _Split(recs, ids, texts, files, dropped, h.hexdigest(), truncated)

  def _split(self, split: str) -> _Split:
    if not self._splits:
      raise RuntimeError("the dataset task is not bound: call task.bind(tokenizer, max_prompt_len) first "
                         "(rl_jax.tasks.build.bind_task)")
    if split == "eval" and not self.has_eval:
      raise ConfigError("config key 'task.eval_files': empty, so there are no eval prompts (set it, or leave "
                        "evaluation off: a run without eval files never evaluates)")
    if split not in self._splits:
      raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    return self._splits[split]

  def sources(self, split: str = "train") -> list[str]:
    return list(dict.fromkeys(r.data_source for r in self._split(split).records))

  def size(self, split: str) -> int:
    return len(self._split(split).records)

  def _order(self, seed: int) -> order_lib.Order:
    if seed not in self._orders:
      recs = self._split("train").records
      if self._weights:
        # Grouped by source: the order's item index is offset + position within the source.
        self._by_source = {s: [i for i, r in enumerate(recs) if r.data_source == s] for s in self.sources()}
        sizes = {s: len(v) for s, v in self._by_source.items()}
      else:
        sizes = {"all": len(recs)}
      self._orders[seed] = order_lib.Order(sizes, seed, self._weights or None, self.config.shuffle)
    return self._orders[seed]

  def record_index(self, seed: int, split: str, index: int) -> int:
    """The position in the split's kept records of the problem at `index`."""
    if split == "eval":
      return self._eval_order[index]
    o = self._order(seed)
    item = o.item(index)
    if not self._weights:
      return item
    s = int(np.searchsorted(o.offsets, item, side="right")) - 1
    return self._by_source[o.sources[s]][item - int(o.offsets[s])]

  # -- the Task protocol ------------------------------------------------------------------------

  def make_problems(self, seed: int, split: str, start: int, count: int) -> list[Record]:
    """Train: positions start .. start + count - 1 of the epoch-wise shuffled (or weighted) order;
    eval: the eval prompts with the sources interleaved (`interleave`), so any eval_size covers
    every source; a count above their number is an error."""
    sp = self._split(split)
    if split == "eval" and start + count > len(sp.records):
      raise ConfigError(f"config key 'rl.eval_size': {start + count} exceeds the {len(sp.records)} eval "
                        f"prompts of task.eval_files that fit max_prompt_len")
    return [sp.records[self.record_index(seed, split, i)] for i in range(start, start + count)]

  def _lookup(self, problem: Record) -> tuple[str, list[int]]:
    for sp in self._splits.values():
      if sp.pos is None:  # by value: a problem may be a copy of the bound record
        sp.pos = {r: i for i, r in enumerate(sp.records)}
      idx = sp.pos.get(problem)
      if idx is not None:
        return sp.texts[idx], sp.ids[idx]
    raise KeyError(f"problem {problem.origin} is not in the bound dataset")

  def prompt(self, problem: Record) -> str:
    """The rendered prompt text (chat template applied, special tokens as text)."""
    return self._lookup(problem)[0]

  def prompt_ids(self, problem: Record, tok: Any) -> list[int]:
    """Its tokens as rendered at bind (a chat template's own tokens, no extra bos)."""
    del tok
    return self._lookup(problem)[1].tolist()

  def completion(self, problem: Record) -> str:
    """The SFT target: the row's solution field, else the ground truth stated as the source's
    verifier reads it (a \\boxed{}, GSM8K's '#### x', DAPO's 'Answer: x')."""
    if problem.solution:
      return problem.solution
    gt = problem.ground_truth
    return verifiers_lib.reference_answer(self.verifier_of(problem.data_source),
                                          gt if isinstance(gt, str) else json.dumps(gt))

  def answer_keys(self, problem: Record, completions: Sequence[str]) -> list[str | None] | None:
    """The answers `completions` of `problem` state, as its source's verifier reads them (maj@k's
    votes); None for a verifier whose answers are not read as text (countdown, a user function)."""
    spec = self.verifier_of(problem.data_source)
    if not verifiers_lib.reads_answers(spec):
      return None
    return [verifiers_lib.answer_key(spec, c) for c in completions]

  def source_of(self, problem: Record) -> str:
    return problem.data_source

  def verifier_of(self, source: str) -> str:
    return verifiers_lib.choose(source, self._rules, self.config.default_verifier)

  def score_batch(self, problems: Sequence[Record], completions: Sequence[str]) -> list[Verdict]:
    """Verdicts of a batch: in-process verifiers inline, isolated ones on the sandbox's workers
    (identical (problem, completion) pairs, common within a group, verified once)."""
    out: list[Verdict | None] = [None] * len(problems)
    boxed = self.config.boxed
    calls, slots = [], []
    first: dict[tuple, int] = {}   # a group's identical completions are verified once
    for i, (p, text) in enumerate(zip(problems, completions)):
      spec = self.verifier_of(p.data_source)
      text = text[-verifiers_lib.TAIL_CHARS:] if isinstance(text, str) else ""
      if verifiers_lib.is_isolated(spec):
        key = (spec, p, text)
        if key in first:
          slots.append((i, first[key]))
          continue
        first[key] = len(calls)
        calls.append((spec, [p.data_source, text, p.ground_truth, p.extra_info, boxed]))
        slots.append((i, first[key]))
        continue
      try:
        out[i] = Verdict(*verifiers_lib.call_local(spec, p.data_source, text, p.ground_truth, p.extra_info,
                                                   boxed))
      except Exception as e:  # pylint: disable=broad-except
        out[i] = Verdict(0.0, sandbox.EXCEPTION, sandbox.exception_text(e))
    if calls:
      if self._pool is None:
        c = self.config
        self._pool = sandbox.Pool(c.verifier_workers, c.verifier_timeout_s, c.verifier_memory_mb)
      details: list[str] = []
      results = self._pool.run(calls, details)
      for i, j in slots:
        out[i] = Verdict(*results[j], details[j])
    self._check_failures(problems, out)  # type: ignore[arg-type]
    return out  # type: ignore[return-value]

  def _check_failures(self, problems: Sequence[Record], verdicts: Sequence[Verdict]) -> None:
    """Stops on a verifier that failed on more than `max_verifier_failures` of its calls here: its
    zero rewards would train on nothing but the verifier's bug."""
    calls: collections.Counter = collections.Counter()
    failed: dict[str, list[int]] = collections.defaultdict(list)
    for i, (p, v) in enumerate(zip(problems, verdicts)):
      spec = self.verifier_of(p.data_source)
      calls[spec] += 1
      if v.error in _VERIFIER_FAILURES:
        failed[spec].append(i)
    limit = self.config.max_verifier_failures
    for spec, rows in failed.items():
      if len(rows) <= limit * calls[spec]:
        continue
      first = rows[0]
      v, p = verdicts[first], problems[first]
      what = v.detail or ("it returned no number (verl's compute_score returns a number, a bool or a "
                          "dict with 'score')" if v.error == sandbox.BAD_RESULT else v.error)
      raise VerifierError(f"config key 'task.overrides.verifiers': verifier {spec!r} failed on {len(rows)} of "
                          f"{calls[spec]} calls of this batch (more than task.overrides.max_verifier_failures="
                          f"{limit}): {what}; first at {p.origin} (data_source {p.data_source!r})")

  def reward_details(self, problem: Record, completion: str) -> Verdict:
    return self.score_batch([problem], [completion])[0]

  def reward(self, problem: Record, completion: str) -> float:
    return self.reward_details(problem, completion).reward

  # -- position in the data (checkpoint metadata) ------------------------------------------------

  def data_state(self, consumed: int) -> dict:
    """What a checkpoint stores: train prompts consumed and the data's fingerprint."""
    sp = self._split("train")
    return {"consumed": int(consumed), "epoch": consumed / len(sp.records), "train_prompts": len(sp.records),
            "fingerprint": sp.fingerprint,
            "eval_fingerprint": self._split("eval").fingerprint if self.has_eval else None}

  def check_data_state(self, state: dict, consumed: int) -> None:
    """A resume continues at `consumed` only over the very data the checkpoint was trained on."""
    mine = self.data_state(consumed)
    if state.get("fingerprint") != mine["fingerprint"]:
      raise ConfigError(f"config key 'task.train_files': the train prompts differ from the checkpoint's "
                        f"({state.get('train_prompts')} prompts, fingerprint {state.get('fingerprint')}; now "
                        f"{mine['train_prompts']}, {mine['fingerprint']}): resuming would repeat or skip "
                        "prompts. Restore the files, or start a new workdir")
    if state.get("consumed") != consumed:
      raise ConfigError(f"checkpoint data position {state.get('consumed')} != {consumed} prompts implied by its step")

  def stats(self) -> dict:
    """Counts for the log / metrics: kept and dropped (too long) prompts per split."""
    out = {}
    for split, sp in self._splits.items():
      out[f"data/{split}_prompts"] = float(len(sp.records))
      out[f"data/{split}_dropped_too_long"] = float(sum(sp.dropped.values()))
      out[f"data/{split}_truncated"] = float(sp.truncated)
    return out

  def close(self) -> None:
    if self._pool is not None:
      self._pool.close()
      self._pool = None


def interleave(sources: Sequence[str]) -> list[int]:
  """Record indices taking each source's next record in turn (file order within a source), until
  all are taken: [a0, b0, a1, b1, a2, ...] for sources a, b."""
  queues = collections.OrderedDict()
  for i, s in enumerate(sources):
    queues.setdefault(s, collections.deque()).append(i)
  out = []
  while queues:
    for s in list(queues):
      out.append(queues[s].popleft())
      if not queues[s]:
        del queues[s]
  return out


@register_task("dataset")
def _dataset(overrides) -> DatasetTask:
  """Prompts from files (DatasetConfig: task.train_files / eval_files and task.overrides)."""
  return DatasetTask(from_dict(DatasetConfig, dict(overrides), prefix="task.overrides"))
