"""CharTokenizer: round trips, answer-tag tokens, unknown characters, eos/pad handling, batch padding."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_jax.tasks import tokenizer as T

TOK = T.CharTokenizer()


def test_special_ids_and_vocab():
  assert (TOK.pad_id, TOK.bos_id, TOK.eos_id) == (0, 1, 2)
  assert (TOK.answer_open_id, TOK.answer_close_id) == (3, 4)
  assert TOK.vocab_size == 5 + len(T.COUNTDOWN_CHARS) == 78
  assert isinstance(TOK, T.Tokenizer)


def test_round_trip_and_tag_tokens():
  text = "nums 3 7 2 target 23 <answer>3*7+2</answer>"
  ids = TOK.encode(text)
  assert ids.count(TOK.answer_open_id) == 1 and ids.count(TOK.answer_close_id) == 1
  assert len(ids) == len("nums 3 7 2 target 23 ") + 1 + len("3*7+2") + 1
  assert TOK.decode(ids) == text
  assert all(0 <= i < TOK.vocab_size for i in ids)
  assert TOK.encode("") == [] and TOK.decode([]) == ""


@settings(max_examples=100, deadline=None, database=None)
@given(st.lists(st.sampled_from(list(T.COUNTDOWN_CHARS) + ["<answer>", "</answer>"])).map("".join))
def test_round_trip_property(text):
  assert TOK.decode(TOK.encode(text)) == text


@pytest.mark.parametrize("text, char", [
    ("nums 3 é", "'é'"), ("3=4", "'='"), ("<think>", "'<'"), ("<answer", "'<'"),
    ("a>b", "'>'"), ("tab\there", "'\\t'"), ("\u0663", "U+0663"),
])
def test_unknown_character(text, char):
  with pytest.raises(ValueError, match=char.replace("\\", "\\\\").replace("+", "\\+")):
    TOK.encode(text)


def test_decode_stops_at_eos_and_skips_pad_bos():
  ids = [TOK.pad_id, TOK.bos_id] + TOK.encode("1+2") + [TOK.eos_id] + TOK.encode("junk")
  assert TOK.decode(ids) == "1+2"
  assert TOK.decode(np.array([0, 0] + TOK.encode("7") + [0], dtype=np.int32)) == "7"
  # Ids past the vocabulary (padded embedding) decode to U+FFFD instead of raising.
  assert TOK.decode([TOK.vocab_size, -1] + TOK.encode("7")) == "\ufffd\ufffd7"


def test_custom_alphabet_checks():
  assert T.CharTokenizer("0123").vocab_size == 9
  with pytest.raises(ValueError, match="distinct"):
    T.CharTokenizer("00")
  with pytest.raises(ValueError, match="ambiguous"):
    T.CharTokenizer("01<")


def test_encode_batch_padding_sides():
  texts = ["1+2", "", "<answer>9</answer>"]
  ids, lengths = TOK.encode_batch(texts, 6, pad_side="left")
  assert ids.dtype == np.int32 and ids.shape == (3, 6)
  np.testing.assert_array_equal(lengths, [3, 0, 3])
  np.testing.assert_array_equal(ids[0], [0, 0, 0] + TOK.encode("1+2"))
  np.testing.assert_array_equal(ids[1], [0] * 6)
  np.testing.assert_array_equal(ids[2], [0, 0, 0, 3] + TOK.encode("9") + [4])
  ids_r, lengths_r = TOK.encode_batch(texts, 6, pad_side="right", add_bos=True, add_eos=True)
  np.testing.assert_array_equal(lengths_r, [5, 2, 5])
  np.testing.assert_array_equal(ids_r[0], [1] + TOK.encode("1+2") + [2, 0])
  np.testing.assert_array_equal(ids_r[1], [1, 2, 0, 0, 0, 0])
  assert TOK.decode_batch(ids_r) == ["1+2", "", "<answer>9</answer>"]
  ids_m, _ = T.encode_batch(TOK, texts, 6, "left")
  np.testing.assert_array_equal(ids_m, ids)


def test_encode_batch_errors():
  with pytest.raises(ValueError, match="max_len=3"):
    TOK.encode_batch(["1+2", "1+23"], 3)
  with pytest.raises(ValueError, match="max_len=3"):
    TOK.encode_batch(["1+2"], 3, add_eos=True)
  with pytest.raises(ValueError, match="pad_side"):
    TOK.encode_batch(["1"], 3, pad_side="middle")
  with pytest.raises(ValueError, match="'é'"):
    TOK.encode_batch(["é"], 3)
  ids, lengths = TOK.encode_batch([], 4)
  assert ids.shape == (0, 4) and lengths.shape == (0,)
