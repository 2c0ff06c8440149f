"""safetensors_io: write / read round trip, sharding plan, and header checks that name file and tensor."""
import json
import os
import struct

import numpy as np
import pytest

from rl_jax.models import safetensors_io as st

TENSORS = {"a.weight": np.arange(12, dtype=np.float32).reshape(3, 4),
           "b.weight": np.full((5,), 2.5, np.float32),
           "c.weight": np.arange(6, dtype=np.float32).reshape(2, 3) - 1}


def _write(path, tensors=TENSORS):
  specs = [(k, v.shape, "F32") for k, v in tensors.items()]
  st.write_safetensors(str(path), specs, lambda name: tensors[name])
  return str(path)


def test_round_trip_and_lazy_views(tmp_path):
  file = _write(tmp_path / "model.safetensors")
  refs = st.read_header(file)
  assert sorted(refs) == sorted(TENSORS)
  reader = st.Reader()
  for name, arr in TENSORS.items():
    np.testing.assert_array_equal(reader.view(refs[name]), arr)
  assert st.equal_tensors(reader, refs["a.weight"], refs["a.weight"], rows_per_chunk=2)
  assert not st.equal_tensors(reader, refs["a.weight"], refs["c.weight"])
  assert st.index_tensors(str(tmp_path)).keys() == TENSORS.keys()


def test_plan_shards_and_index(tmp_path):
  specs = [(k, v.shape, "F32") for k, v in TENSORS.items()]
  names, shards = st.plan_shards(specs, max_shard_bytes=48)  # a: 48 B, b: 20 B, c: 24 B
  assert names == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
  assert [[t[0] for t in s] for s in shards] == [["a.weight"], ["b.weight", "c.weight"]]
  for fname, shard in zip(names, shards):
    _write(tmp_path / fname, {t[0]: TENSORS[t[0]] for t in shard})
  st.write_index(str(tmp_path), names, shards)
  index = json.loads((tmp_path / st.INDEX_FILE).read_text())
  assert index["metadata"]["total_size"] == 92
  refs = st.index_tensors(str(tmp_path))
  assert os.path.basename(refs["c.weight"].file) == names[1]
  assert st.plan_shards(specs, 10**6)[0] == [st.SINGLE_FILE]


def test_truncated_data_names_file_and_tensor(tmp_path):
  file = _write(tmp_path / "model.safetensors")
  last = max(st.read_header(file).values(), key=lambda r: r.end)
  with open(file, "r+b") as f:
    f.truncate(last.end - 1)
  with pytest.raises(st.CheckpointError, match=rf"model\.safetensors: tensor '{last.name}' needs "
                                               rf"bytes \[{last.begin}, {last.end}\).*truncated"):
    st.read_header(file)
  with open(file, "r+b") as f:
    f.truncate(12)  # inside the header itself
  with pytest.raises(st.CheckpointError, match=r"model\.safetensors: header claims"):
    st.read_header(file)


def test_header_byte_count_must_match_shape(tmp_path):
  header = json.dumps({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 12]}}).encode()
  file = tmp_path / "bad.safetensors"
  file.write_bytes(struct.pack("<Q", len(header)) + header + bytes(16))
  with pytest.raises(st.CheckpointError, match=r"bad\.safetensors: tensor 'w' \(F32 \[2, 2\]\) has "
                                               r"12 bytes of data, expected 16"):
    st.read_header(str(file))

