"""Generic safetensors reading and writing: headers, tensor refs, sharded indexes, streamed shards."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from typing import Any, Callable, Mapping, Sequence

import ml_dtypes
import numpy as np

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# safetensors dtype tag <-> numpy dtype (little endian on disk). numpy has no
# bfloat16, so raw bytes are viewed through ml_dtypes rather than going via torch.
ST_TO_NP = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
}
DTYPE_TO_ST = {"float32": "F32", "bfloat16": "BF16"}


class CheckpointError(ValueError):
  """A checkpoint does not match what rl_jax expects; the message names the tensor / key and file."""


def read_json(path: str) -> dict:
  try:
    with open(path) as f:
      return json.load(f)
  except FileNotFoundError:
    raise CheckpointError(f"{path}: file not found") from None
  except json.JSONDecodeError as e:
    raise CheckpointError(f"{path}: invalid JSON ({e})") from None


@dataclasses.dataclass(frozen=True)
class TensorRef:
  """Where one tensor's bytes lie: file, name, safetensors dtype tag, shape, [begin, end) offsets."""
  file: str
  name: str
  dtype: str            # safetensors tag, e.g. "BF16"
  shape: tuple[int, ...]
  begin: int            # absolute byte offset in the file
  end: int


def read_header(file: str) -> dict[str, TensorRef]:
  """name -> TensorRef of one safetensors file, every byte range checked against the file size.

  A file cut short (an interrupted copy) fails here, naming the file and the first
  tensor whose bytes are missing, instead of deep inside a later read.
  """
  try:
    size = os.path.getsize(file)
    with open(file, "rb") as f:
      (n,) = struct.unpack("<Q", f.read(8))
      if 8 + n > size:
        raise CheckpointError(f"{file}: header claims {n} bytes but the file has {size} bytes "
                              "(truncated?)")
      header = json.loads(f.read(n))
  except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
    raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from None
  if not isinstance(header, Mapping):
    raise CheckpointError(f"{file}: safetensors header is not a JSON object")
  base = 8 + n
  refs = {}
  for name, info in header.items():
    if name == "__metadata__":
      continue
    try:
      b, e = (int(o) for o in info["data_offsets"])
      shape = tuple(int(d) for d in info["shape"])
      dtype = str(info["dtype"])
    except (KeyError, TypeError, ValueError) as err:
      raise CheckpointError(f"{file}: tensor '{name}' has a malformed header entry {info!r} "
                            f"({err!r})") from None
    if not 0 <= b <= e:
      raise CheckpointError(f"{file}: tensor '{name}' has data_offsets [{b}, {e}]")
    if dtype in ST_TO_NP and e - b != math.prod(shape) * ST_TO_NP[dtype].itemsize:
      raise CheckpointError(f"{file}: tensor '{name}' ({dtype} {list(shape)}) has {e - b} bytes "
                            f"of data, expected {math.prod(shape) * ST_TO_NP[dtype].itemsize}")
    if base + e > size:
      raise CheckpointError(f"{file}: tensor '{name}' needs bytes [{base + b}, {base + e}) but the "
                            f"file has only {size} bytes (truncated?)")
    refs[name] = TensorRef(file, name, dtype, shape, base + b, base + e)
  return refs


class Reader:
  """Memory-maps each file once; `view(ref)` is a lazy numpy view of one tensor."""

  def __init__(self):
    self._maps: dict[str, np.memmap] = {}

  def view(self, ref: TensorRef) -> np.ndarray:
    mm = self._maps.get(ref.file)
    if mm is None:
      mm = self._maps[ref.file] = np.memmap(ref.file, dtype=np.uint8, mode="r")
    return mm[ref.begin:ref.end].view(ST_TO_NP[ref.dtype]).reshape(ref.shape)


def index_tensors(path: str) -> dict[str, TensorRef]:
  """name -> TensorRef over all safetensors files of a checkpoint directory.

  Uses `model.safetensors.index.json` when present (every listed tensor must be in its
  file, every file tensor listed), else every `*.safetensors` file (no name twice).
  """
  index_path = os.path.join(path, INDEX_FILE)
  refs: dict[str, TensorRef] = {}
  if os.path.exists(index_path):
    weight_map = read_json(index_path).get("weight_map")
    if not isinstance(weight_map, Mapping):
      raise CheckpointError(f"{index_path}: key 'weight_map' is missing or not a mapping")
    headers: dict[str, dict[str, TensorRef]] = {}
    for name, fname in weight_map.items():
      file = os.path.join(path, fname)
      if fname not in headers:
        if not os.path.exists(file):
          raise CheckpointError(f"{index_path}: tensor '{name}' maps to file '{fname}', which does not exist")
        headers[fname] = read_header(file)
      if name not in headers[fname]:
        raise CheckpointError(f"{index_path}: tensor '{name}' maps to file '{fname}', "
                              "which does not contain it")
      refs[name] = headers[fname][name]
    # Tensors present in a shard but absent from the index would be silently dropped.
    for fname, header in headers.items():
      for name in header:
        if name not in weight_map:
          raise CheckpointError(f"unexpected tensor '{name}' in file '{fname}': not listed in {INDEX_FILE}")
    return refs
  files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors")) if os.path.isdir(path) else []
  if not files:
    raise CheckpointError(f"{path}: no {INDEX_FILE} and no *.safetensors files")
  for fname in files:
    for name, ref in read_header(os.path.join(path, fname)).items():
      if name in refs:
        raise CheckpointError(f"tensor '{name}' appears in both '{os.path.basename(refs[name].file)}' "
                              f"and '{fname}'")
      refs[name] = ref
  return refs


def norm_index(index, shape) -> tuple[slice, ...]:
  """A `make_array_from_callback` index as one unit-step slice per dimension."""
  if index is None:
    index = ()
  index = tuple(index) + (slice(None),) * (len(shape) - len(tuple(index)))
  out = []
  for s, n in zip(index, shape):
    start, stop, step = s.indices(n)
    if step != 1:
      raise ValueError(f"strided shard index {s} not supported")
    out.append(slice(start, stop))
  return tuple(out)


def equal_tensors(reader: Reader, a: TensorRef, b: TensorRef, rows_per_chunk: int = 4096) -> bool:
  """Whether two tensors hold the same values, compared in row chunks (bounded host memory)."""
  if a.shape != b.shape:
    return False
  va, vb = reader.view(a), reader.view(b)
  if va.ndim == 0:
    return bool(va == vb)
  return all(np.array_equal(va[i:i + rows_per_chunk], vb[i:i + rows_per_chunk])
             for i in range(0, va.shape[0], rows_per_chunk))


def write_safetensors(file: str, tensors: Sequence[tuple[str, tuple, str]],
                      produce: Callable[[str], np.ndarray]) -> None:
  """Streams one safetensors file: the header from shapes, then each tensor's bytes in turn."""
  header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
  offset = 0
  for name, shape, st_dtype in tensors:
    nbytes = int(np.prod(shape, dtype=np.int64)) * ST_TO_NP[st_dtype].itemsize
    header[name] = {"dtype": st_dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
    offset += nbytes
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)  # 8-byte aligned data start, as the reference writer does
  with open(file, "wb") as f:
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)
    for name, shape, st_dtype in tensors:
      arr = produce(name)
      if arr.shape != tuple(shape) or arr.dtype != ST_TO_NP[st_dtype]:
        raise ValueError(f"{file}: tensor '{name}' produced {arr.dtype} {arr.shape}, header says "
                         f"{st_dtype} {tuple(shape)}")
      f.write(np.ascontiguousarray(arr).tobytes())


def plan_shards(tensors: Sequence[tuple[str, tuple, str]], max_shard_bytes: int
                ) -> tuple[list[str], list[list[tuple[str, tuple, str]]]]:
  """Splits (name, shape, dtype tag) in order into files of at most `max_shard_bytes`.

  A tensor larger than the limit gets a file of its own. Returns (file names, tensors
  per file): `model.safetensors` alone, or the hub's `model-0000i-of-0000n.safetensors`.
  """
  shards: list[list] = [[]]
  size = 0
  for t in tensors:
    nbytes = int(np.prod(t[1], dtype=np.int64)) * ST_TO_NP[t[2]].itemsize
    if shards[-1] and size + nbytes > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(t)
    size += nbytes
  n = len(shards)
  names = [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
  return names, shards


def write_index(path: str, names: Sequence[str], shards: Sequence[Sequence[tuple[str, tuple, str]]]
                ) -> None:
  """Writes `model.safetensors.index.json` (total size and tensor -> file map) for a sharded save."""
  total = sum(int(np.prod(s, dtype=np.int64)) * ST_TO_NP[d].itemsize
              for shard in shards for _, s, d in shard)
  index = {"metadata": {"total_size": total},
           "weight_map": {t[0]: f for f, shard in zip(names, shards) for t in shard}}
  with open(os.path.join(path, INDEX_FILE), "w") as f:
    json.dump(index, f, indent=2, sort_keys=True)
