"""HFTokenizer: a local `tokenizer.json` (+ tokenizer_config.json) behind rl_jax's Tokenizer protocol."""
from __future__ import annotations

import datetime
import json
import os
from typing import Any, Mapping, Sequence

import numpy as np
import tokenizers

from rl_jax import artifacts
from rl_jax.tasks.tokenizer import BatchCodec

REPLACEMENT_CHAR = "\ufffd"


def _read_json(path: str) -> dict:
  return artifacts.read_json(path) or {}   # a file the checkpoint lacks reads as {}


def _token_content(value: Any) -> str | None:
  """A special token as tokenizer_config.json spells it: a string or a serialized AddedToken."""
  if value is None or isinstance(value, str):
    return value
  if isinstance(value, Mapping) and "content" in value:
    return value["content"]
  raise ValueError(f"cannot read special token {value!r}")


def _ids(value: Any) -> list[int]:
  if value is None:
    return []
  return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


class HFTokenizer(BatchCodec):
  """A Hugging Face fast tokenizer with the same small interface as CharTokenizer.

  `encode` adds no special tokens (bos / eos are added by `encode_batch` flags),
  and `decode` mirrors CharTokenizer: leading pad ids (left padding) are
  skipped, decoding stops at the first eos id (any of `eos_ids`), remaining pad
  and bos ids are dropped, other special tokens are kept as text, and ids
  outside the vocabulary become U+FFFD instead of raising.

  Special tokens come from tokenizer_config.json (`pad_token`, `bos_token`,
  `eos_token`, as strings or serialized AddedTokens), then special_tokens_map.json.
  Qwen3 has no bos token: `bos_id` then falls back to `bos_token_id` of
  config.json / generation_config.json, then to `pad_id`; `has_bos` tells which.
  `pad_id` falls back to `eos_id`.
  """

  def __init__(self, tokenizer: tokenizers.Tokenizer, *, eos_token: str, pad_token: str | None = None,
               bos_token: str | None = None, bos_id: int | None = None,
               extra_eos_ids: Sequence[int] = (), chat_template: str | None = None,
               source: str = "<tokenizer>"):
    self._tok = tokenizer
    self._source = source
    self._eos_id = self._require(eos_token, "eos_token")
    self._pad_id = self._require(pad_token, "pad_token") if pad_token is not None else self._eos_id
    self._has_bos = bos_token is not None
    if bos_token is not None:
      self._bos_id = self._require(bos_token, "bos_token")
    else:
      self._bos_id = bos_id if bos_id is not None else self._pad_id
    self._eos_ids = tuple(dict.fromkeys([self._eos_id, *extra_eos_ids]))
    self._tokens = {"eos_token": eos_token, "pad_token": pad_token, "bos_token": bos_token}
    self.chat_template = chat_template

  def _require(self, token: str, key: str) -> int:
    tid = self._tok.token_to_id(token)
    if tid is None:
      raise ValueError(f"{self._source}: {key} {token!r} is not in the tokenizer's vocabulary")
    return tid

  @classmethod
  def from_dir(cls, path: str, *, eos_token: str | None = None, pad_token: str | None = None,
               bos_token: str | None = None) -> "HFTokenizer":
    """Loads `path`/tokenizer.json and, where present, tokenizer_config.json,
    special_tokens_map.json, chat_template.jinja, config.json and generation_config.json.

    Keyword tokens override the files (e.g. eos_token='<|endoftext|>' for a base model).
    """
    tok_file = os.path.join(path, "tokenizer.json")
    if not os.path.exists(tok_file):
      raise FileNotFoundError(f"{path}: no tokenizer.json (only fast tokenizers are supported)")
    tok = tokenizers.Tokenizer.from_file(tok_file)
    tcfg = _read_json(os.path.join(path, "tokenizer_config.json"))
    smap = _read_json(os.path.join(path, "special_tokens_map.json"))
    gen = _read_json(os.path.join(path, "generation_config.json"))
    model_cfg = _read_json(os.path.join(path, "config.json"))

    def special(key, override):
      if override is not None:
        return override
      return _token_content(tcfg.get(key)) or _token_content(smap.get(key))

    eos = special("eos_token", eos_token)
    extra_eos = _ids(gen.get("eos_token_id")) + _ids(model_cfg.get("eos_token_id"))
    if eos is None:
      if not extra_eos:
        raise ValueError(f"{path}: no eos_token in tokenizer_config.json / special_tokens_map.json "
                         "and no eos_token_id in generation_config.json / config.json")
      eos = tok.id_to_token(extra_eos[0])
    bos_id = next(iter(_ids(gen.get("bos_token_id")) + _ids(model_cfg.get("bos_token_id"))), None)
    template = tcfg.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
      named = {t["name"]: t["template"] for t in template}
      template = named.get("default", next(iter(named.values()), None))
    jinja_file = os.path.join(path, "chat_template.jinja")
    if template is None and os.path.exists(jinja_file):
      with open(jinja_file) as f:
        template = f.read()
    return cls(tok, eos_token=eos, pad_token=special("pad_token", pad_token),
               bos_token=special("bos_token", bos_token), bos_id=bos_id, extra_eos_ids=extra_eos,
               chat_template=template, source=path)

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size(with_added_tokens=True)

  @property
  def pad_id(self) -> int:
    return self._pad_id

  @property
  def bos_id(self) -> int:
    return self._bos_id

  @property
  def has_bos(self) -> bool:
    return self._has_bos

  @property
  def eos_id(self) -> int:
    return self._eos_id

  @property
  def eos_ids(self) -> tuple[int, ...]:
    """eos_id plus generation_config.json's eos ids (Qwen3 chat: <|im_end|>, <|endoftext|>)."""
    return self._eos_ids

  @property
  def backend(self) -> tokenizers.Tokenizer:
    return self._tok

  def encode(self, text: str) -> list[int]:
    """Text -> ids, no bos / eos added; added tokens (e.g. <|im_start|>) in the text match as one id."""
    return list(self._tok.encode(text, add_special_tokens=False).ids)

  def decode(self, ids: Sequence[int]) -> str:
    """Ids -> text; see the class docstring for the pad / bos / eos rules."""
    ids = [int(t) for t in np.asarray(ids).reshape(-1)]
    start = 0
    while start < len(ids) and ids[start] == self._pad_id:
      start += 1
    kept: list[int | None] = []
    drop = {self._pad_id, self._bos_id}
    n = self.vocab_size
    for t in ids[start:]:
      if t in self._eos_ids:
        break
      if t in drop:
        continue
      kept.append(t if 0 <= t < n else None)
    # Decode runs of valid ids together so byte-level merges across tokens survive.
    out: list[str] = []
    run: list[int] = []
    for t in kept:
      if t is not None:
        run.append(t)
        continue
      if run:
        out.append(self._tok.decode(run, skip_special_tokens=False))
        run = []
      out.append(REPLACEMENT_CHAR)
    if run:
      out.append(self._tok.decode(run, skip_special_tokens=False))
    return "".join(out)

  def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *,
                          add_generation_prompt: bool = False, **kwargs) -> str:
    """Renders the checkpoint's chat template (jinja2, sandboxed, as transformers does).

    Extra kwargs reach the template (e.g. enable_thinking=False for Qwen3).
    """
    if self.chat_template is None:
      raise ValueError(f"{self._source}: no chat_template in tokenizer_config.json or chat_template.jinja")
    context = {k: v for k, v in self._tokens.items() if v is not None}
    context.update(messages=list(messages), add_generation_prompt=add_generation_prompt, **kwargs)
    return self._compiled_template().render(**context)

  def _compiled_template(self):
    """The chat template compiled once per template text (a compile costs ~5 ms, a render ~0.1 ms:
    a dataset renders every prompt at load)."""
    cached = getattr(self, "_template_cache", None)
    if cached is not None and cached[0] == self.chat_template:
      return cached[1]
    import jinja2  # pylint: disable=g-import-not-at-top
    from jinja2 import sandbox  # pylint: disable=g-import-not-at-top

    def raise_exception(message):
      raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
      # jinja's own tojson HTML-escapes; transformers' version does not.
      return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                        sort_keys=sort_keys)

    env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    compiled = env.from_string(self.chat_template)
    self._template_cache = (self.chat_template, compiled)
    return compiled


__all__ = ["HFTokenizer"]
