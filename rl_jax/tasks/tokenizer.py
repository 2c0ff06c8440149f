"""Tokenizer protocol, a character tokenizer for Countdown, and padded batch encoding."""
from __future__ import annotations

import string
from typing import Literal, Protocol, Sequence, runtime_checkable

import numpy as np

PadSide = Literal["left", "right"]


@runtime_checkable
class Tokenizer(Protocol):
  """What the SFT / RL jobs need from a tokenizer (CharTokenizer or an HF adapter)."""

  @property
  def vocab_size(self) -> int: ...

  @property
  def pad_id(self) -> int: ...

  @property
  def bos_id(self) -> int: ...

  @property
  def eos_id(self) -> int: ...

  def encode(self, text: str) -> list[int]: ...

  def decode(self, ids: Sequence[int]) -> str: ...


# Special tokens. The answer tags are single tokens: sequences stay short for a
# char-level model, a tag can never be emitted half-formed, and with '<' and '>'
# absent from the alphabet every text has exactly one encoding.
PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
SPECIAL_TOKENS = (PAD, BOS, EOS, ANSWER_OPEN, ANSWER_CLOSE)
# Everything both Countdown prompt styles and completions use: expressions
# (digits, + - * / ( ) and space) and the paper-style instruction (letters,
# `[ ] , .`). All letters are included so rewording a prompt needs no vocab change.
COUNTDOWN_CHARS = (" " + string.digits + "+-*/()" + string.ascii_lowercase
                   + string.ascii_uppercase + "[],.")
REPLACEMENT_CHAR = "\ufffd"


class BatchCodec:
  """Batch encode / decode for any tokenizer with `encode` / `decode` and the special ids."""

  def encode_batch(self, texts: Sequence[str], max_len: int, pad_side: PadSide = "left",
                   add_bos: bool = False, add_eos: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """See the module-level encode_batch."""
    return encode_batch(self, texts, max_len, pad_side=pad_side, add_bos=add_bos, add_eos=add_eos)

  def decode_batch(self, ids: np.ndarray) -> list[str]:
    return [self.decode(row) for row in np.asarray(ids)]


class CharTokenizer(BatchCodec):
  """One id per character of `chars`, after the special tokens (pad=0, bos=1, eos=2).

  `<answer>` and `</answer>` are encoded as single tokens (ids 3, 4) wherever
  they occur in the text, and decoded back to the same text, so
  decode(encode(t)) == t for every encodable t.
  """

  def __init__(self, chars: str = COUNTDOWN_CHARS):
    if len(set(chars)) != len(chars):
      raise ValueError(f"CharTokenizer chars must be distinct, got {chars!r}")
    if "<" in chars or ">" in chars:
      raise ValueError("'<' and '>' would make the answer-tag encoding ambiguous")
    self._chars = chars
    self._specials = SPECIAL_TOKENS
    n_special = len(self._specials)
    self._char_to_id = {c: n_special + i for i, c in enumerate(chars)}
    self._id_to_text = list(self._specials) + list(chars)
    self._answer_open_id = self._specials.index(ANSWER_OPEN)
    self._answer_close_id = self._specials.index(ANSWER_CLOSE)

  @property
  def vocab_size(self) -> int:
    return len(self._id_to_text)

  @property
  def pad_id(self) -> int:
    return 0

  @property
  def bos_id(self) -> int:
    return 1

  @property
  def eos_id(self) -> int:
    return 2

  @property
  def answer_open_id(self) -> int:
    return self._answer_open_id

  @property
  def answer_close_id(self) -> int:
    return self._answer_close_id

  def encode(self, text: str) -> list[int]:
    """Text -> ids (no bos/eos added); raises ValueError naming an unknown character."""
    ids: list[int] = []
    i, n = 0, len(text)
    while i < n:
      c = text[i]
      if c == "<":
        if text.startswith(ANSWER_OPEN, i):
          ids.append(self._answer_open_id)
          i += len(ANSWER_OPEN)
          continue
        if text.startswith(ANSWER_CLOSE, i):
          ids.append(self._answer_close_id)
          i += len(ANSWER_CLOSE)
          continue
      tok = self._char_to_id.get(c)
      if tok is None:
        hint = f"; '<' only starts {ANSWER_OPEN} / {ANSWER_CLOSE}" if c == "<" else ""
        raise ValueError(
            f"CharTokenizer cannot encode character {c!r} (U+{ord(c):04X}) at position {i} "
            f"of {text[:80]!r}{hint}")
      ids.append(tok)
      i += 1
    return ids

  def decode(self, ids: Sequence[int]) -> str:
    """Ids -> text: stops at the first eos, skips pad and bos.

    Ids outside the vocabulary (a model whose embedding is padded past
    vocab_size) decode to U+FFFD rather than raising: sampled ids are
    untrusted, and the reward then simply fails to parse them.
    """
    out = []
    for t in ids:
      t = int(t)
      if t == self.eos_id:
        break
      if t == self.pad_id or t == self.bos_id:
        continue
      out.append(self._id_to_text[t] if 0 <= t < len(self._id_to_text) else REPLACEMENT_CHAR)
    return "".join(out)


def encode_batch(tokenizer: Tokenizer, texts: Sequence[str], max_len: int,
                 pad_side: PadSide = "left", add_bos: bool = False,
                 add_eos: bool = False) -> tuple[np.ndarray, np.ndarray]:
  """Encodes and pads to a fixed width (static shapes for jit).

  Returns (ids int32 [B, max_len], lengths int32 [B]); lengths count the
  non-pad tokens, bos/eos included. Left padding suits prompts (all end at
  column max_len - 1, where generation starts); right padding suits targets.
  A text longer than max_len raises ValueError: truncation would silently
  change a prompt or a training target.
  """
  if pad_side not in ("left", "right"):
    raise ValueError(f"pad_side must be 'left' or 'right', got {pad_side!r}")
  if max_len < 1:
    raise ValueError(f"max_len must be >= 1, got {max_len}")
  rows = []
  for b, text in enumerate(texts):
    ids = tokenizer.encode(text)
    if add_bos:
      ids = [tokenizer.bos_id] + ids
    if add_eos:
      ids = ids + [tokenizer.eos_id]
    if len(ids) > max_len:
      raise ValueError(f"text {b} encodes to {len(ids)} tokens > max_len={max_len}: {text[:80]!r}")
    rows.append(ids)
  out = np.full((len(rows), max_len), tokenizer.pad_id, dtype=np.int32)
  lengths = np.zeros((len(rows),), dtype=np.int32)
  for b, ids in enumerate(rows):
    lengths[b] = len(ids)
    if not ids:
      continue
    if pad_side == "left":
      out[b, max_len - len(ids):] = ids
    else:
      out[b, :len(ids)] = ids
  return out, lengths
