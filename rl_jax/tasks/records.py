"""Prompt records from jsonl / parquet files (local, gs://, s3:// via etils.epath): verl's schema or a mapped one."""
from __future__ import annotations

import dataclasses
import glob as glob_lib
import io
import json
import os
from typing import Any, Iterator, Mapping, Sequence

from etils import epath

from rl_jax import workdir as wd
from rl_jax.config_utils import ConfigError

_GLOB_CHARS = frozenset("*?[")


class DataError(ConfigError):
  """A prompt file's content is malformed; the message names the file, the row and the field (a
  ConfigError: the entry point prints it on one line before any compute, like a bad key)."""


SUFFIXES = (".jsonl", ".json", ".parquet")
ROLES = frozenset({"system", "user", "assistant", "tool"})


@dataclasses.dataclass(frozen=True)
class Fields:
  """Where each part of a record lives in a row: dotted paths (`reward_model.ground_truth`).

  verl's schema is the default; an empty `source` means every row belongs to `default_source`,
  an empty `solution` that the SFT target is written from the ground truth.
  """
  prompt: str = "prompt"
  source: str = "data_source"
  answer: str = "reward_model.ground_truth"
  extra: str = "extra_info"
  solution: str = ""
  default_source: str = ""


@dataclasses.dataclass(frozen=True)
class Record:
  """One prompt: messages ((role, content), ...) or a plain string, and what its verifier needs.

  The ground truth and extra info are kept as canonical JSON so the record is hashable and
  compares by value (the Task protocol's problem type); `origin` is `file:row` for messages.
  """
  data_source: str
  prompt: tuple[tuple[str, str], ...] | str
  ground_truth_json: str
  extra_json: str
  solution: str
  origin: str

  @property
  def ground_truth(self) -> Any:
    return json.loads(self.ground_truth_json)

  @property
  def extra_info(self) -> dict:
    return json.loads(self.extra_json)

  @property
  def messages(self) -> list[dict]:
    if isinstance(self.prompt, str):
      return [{"role": "user", "content": self.prompt}]
    return [{"role": r, "content": c} for r, c in self.prompt]


# The filesystem package etils.epath needs per remote scheme, and the rl_jax extra that installs it.
REMOTE_PACKAGES = {"gs": ("gcsfs", "gcs"), "s3": ("s3fs", "s3")}


def expand(patterns: str, key: str) -> list[str]:
  """Comma-separated paths or globs -> the sorted files each matches (every pattern must match).

  Remote patterns (gs://, s3://) are globbed through etils.epath like workdirs are.
  """
  try:
    return _expand(patterns, key)
  except ImportError as e:  # etils reaches gs:// through gcsfs and s3:// through s3fs, optional packages
    scheme = next((p.strip().split("://", 1)[0] for p in patterns.split(",") if "://" in p), "")
    package, extra = REMOTE_PACKAGES.get(scheme, ("", ""))
    hint = f": pip install 'rl_jax[{extra}]' (or {package})" if package else ""
    raise ConfigError(f"config key '{key}': reading {scheme}:// files needs {package or 'a filesystem package'}"
                      f"{hint} ({e})") from None


def _expand(patterns: str, key: str) -> list[str]:
  out: list[str] = []
  for pat in [p.strip() for p in patterns.split(",") if p.strip()]:
    if not any(c in pat for c in _GLOB_CHARS):
      path = wd.as_path(pat, key)
      if not path.exists():
        raise ConfigError(f"config key '{key}': no such file {pat!r}")
      out.append(os.fspath(path) if "://" in pat else str(path))
      continue
    if "://" not in pat:
      found = sorted(glob_lib.glob(os.path.expanduser(pat)))
    else:
      parts = pat.split("/")
      first = next(i for i, p in enumerate(parts) if any(c in p for c in _GLOB_CHARS))
      root = wd.as_path("/".join(parts[:first]), key)
      found = sorted(os.fspath(p) for p in root.glob("/".join(parts[first:])))
    if not found:
      raise ConfigError(f"config key '{key}': no file matches {pat!r}")
    out.extend(found)
  if not out:
    raise ConfigError(f"config key '{key}': empty (a comma-separated list of files or globs)")
  for f in out:
    if not f.endswith(SUFFIXES):
      raise ConfigError(f"config key '{key}': {f} is neither .jsonl nor .parquet")
  return out


def read_rows(path: str) -> Iterator[tuple[int, dict]]:
  """(row number, row dict) of a .jsonl or .parquet file; a malformed line names file and line."""
  p = epath.Path(path)
  if path.endswith(".parquet"):
    import pyarrow as pa  # pylint: disable=g-import-not-at-top
    import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
    try:
      table = pq.read_table(io.BytesIO(p.read_bytes()))
    except (pa.ArrowException, OSError, ValueError) as e:   # a corrupt or truncated file
      first = (str(e).strip().splitlines() or [type(e).__name__])[0]
      raise DataError(f"{path}: not a readable parquet file ({first[:200]})") from None
    for i, row in enumerate(table.to_pylist()):
      yield i, row
    return
  with p.open("rb") as f:
    for i, raw in enumerate(f):
      try:
        line = raw.decode("utf-8-sig" if i == 0 else "utf-8")   # a leading byte-order mark is allowed
      except UnicodeDecodeError as e:
        raise DataError(f"{path}:{i + 1}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                        "prompt files are UTF-8 text") from None
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except json.JSONDecodeError as e:
        raise DataError(f"{path}:{i + 1}: not valid JSON ({e.msg})") from None
      if not isinstance(row, dict):
        raise DataError(f"{path}:{i + 1}: a row must be a JSON object, got {type(row).__name__}")
      yield i, row


_MISSING = object()


def lookup(row: Mapping[str, Any], dotted: str) -> Any:
  """row['a']['b'] for 'a.b'; _MISSING where a part is absent. A JSON string on the way is decoded
  (parquet writers often store nested dicts such as extra_info as JSON text)."""
  node: Any = row
  for part in dotted.split("."):
    if isinstance(node, str):
      try:
        node = json.loads(node)
      except json.JSONDecodeError:
        return _MISSING
    if not isinstance(node, Mapping) or part not in node:
      return _MISSING
    node = node[part]
  return node


def _empty(value: Any) -> bool:
  """A missing ground truth: null, NaN (pandas' missing value), a blank string, an empty list / dict."""
  if value is None:
    return True
  if isinstance(value, float):
    return value != value
  if isinstance(value, str):
    return not value.strip()
  return isinstance(value, (list, tuple, dict)) and not value


def _as_messages(text: str) -> list | None:
  """A prompt string that is the JSON text of a chat-message list (pandas writing a list column
  as text does this), decoded; None for any other string, which stays a plain prompt."""
  if not text.lstrip().startswith("["):
    return None
  try:
    value = json.loads(text)
  except json.JSONDecodeError:
    return None
  if isinstance(value, list) and value and all(isinstance(m, dict) and "role" in m for m in value):
    return value
  return None


def _prompt(value: Any, where: str, field: str) -> tuple[tuple[str, str], ...] | str:
  if isinstance(value, str):
    if not value:
      raise DataError(f"{where}: field '{field}' is an empty string")
    messages = _as_messages(value)
    if messages is None:
      return value
    value = messages
  if hasattr(value, "tolist"):  # a numpy array of messages (pandas-written parquet)
    value = value.tolist()
  if not isinstance(value, Sequence) or not value:
    raise DataError(f"{where}: field '{field}' must be a string or a non-empty list of chat messages "
                     f"({{'role': ..., 'content': ...}}), got {type(value).__name__}")
  out = []
  for j, m in enumerate(value):
    if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
      raise DataError(f"{where}: field '{field}'[{j}] must be a message {{'role': str, 'content': str}}, "
                       f"got {m!r:.120}")
    if m["role"] not in ROLES:
      raise DataError(f"{where}: field '{field}'[{j}] has role {m['role']!r}; valid: {sorted(ROLES)}")
    out.append((m["role"], m["content"]))
  return tuple(out)


def _json(value: Any, where: str, field: str) -> str:
  if hasattr(value, "tolist"):
    value = value.tolist()
  try:
    return json.dumps(value, sort_keys=True, ensure_ascii=False)
  except TypeError as e:
    raise DataError(f"{where}: field '{field}' is not JSON-serializable ({e})") from None


def to_record(row: Mapping[str, Any], fields: Fields, where: str) -> Record:
  """One row -> Record; a missing or malformed field raises DataError naming `where` and the field."""
  prompt = lookup(row, fields.prompt)
  if prompt is _MISSING:
    raise DataError(f"{where}: no field '{fields.prompt}' (the prompt; map another field with "
                     f"task.overrides.prompt_key); row keys: {sorted(row)}")
  if fields.source:
    source = lookup(row, fields.source)
    if source is _MISSING or source is None:
      if not fields.default_source:
        raise DataError(f"{where}: no field '{fields.source}' (the data source; map another with "
                         "task.overrides.source_key or set task.overrides.default_source)")
      source = fields.default_source
  else:
    source = fields.default_source
  if not isinstance(source, str) or not source.strip():
    raise DataError(f"{where}: field '{fields.source}' must be a non-empty string, got {source!r}")
  answer = lookup(row, fields.answer)
  if answer is _MISSING:
    raise DataError(f"{where}: no field '{fields.answer}' (the ground truth; map another with "
                     "task.overrides.answer_key)")
  if hasattr(answer, "tolist"):
    answer = answer.tolist()
  if _empty(answer):
    # A row without a ground truth cannot be graded, and a verifier comparing with its text
    # ('None', '') can be gamed: refused here rather than scored per call.
    raise DataError(f"{where}: field '{fields.answer}' is {'null' if answer is None else repr(answer)}: "
                     "every row needs a ground truth (drop the row or fill it in)")
  extra = lookup(row, fields.extra) if fields.extra else _MISSING
  extra = {} if extra is _MISSING or extra is None else extra
  if isinstance(extra, str):
    try:
      extra = json.loads(extra)
    except json.JSONDecodeError:
      extra = {"text": extra}
  solution = ""
  if fields.solution:
    sol = lookup(row, fields.solution)
    if sol is _MISSING or not isinstance(sol, str):
      raise DataError(f"{where}: no string field '{fields.solution}' (the SFT target, "
                       "task.overrides.solution_key)")
    solution = sol
  return Record(data_source=source, prompt=_prompt(prompt, where, fields.prompt),
                ground_truth_json=_json(answer, where, fields.answer),
                extra_json=_json(extra, where, fields.extra or "extra_info"), solution=solution,
                origin=where)


def read_records(files: Sequence[str], fields: Fields) -> list[Record]:
  """Every row of `files`, in file order then row order; a file without rows is an error."""
  out = []
  for path in files:
    n = len(out)
    for i, row in read_rows(path):
      out.append(to_record(row, fields, f"{path}:{i + 1}"))
    if len(out) == n:
      raise DataError(f"{path}: no rows (the file is empty)")
  return out


def write_jsonl(path: str, rows: Sequence[Mapping[str, Any]]) -> None:
  epath.Path(path).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def write_parquet(path: str, rows: Sequence[Mapping[str, Any]]) -> None:
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  buf = io.BytesIO()
  pq.write_table(pa.Table.from_pylist(list(rows)), buf)
  epath.Path(path).write_bytes(buf.getvalue())
