"""Trace-time record of the implementation each dispatch point chose (attention, expert matmul, quantized linears)."""
# The model's dispatch points (ops/attention.py, models/moe.py, ops/quantized.py, ops/linear.py) resolve `auto`
# choices while jax traces, from the backend, dtypes and shapes. Each calls `record(point,
# choice)`; inside `recording()` the choices are collected, so a test or a benchmark can say
# which implementations a compiled program holds without reading its HLO. Outside `recording()`
# nothing is kept (a trace costs one Python call per dispatch point). A jit cache hit traces
# nothing, so record around the first call of a program.
from __future__ import annotations

import collections
import contextlib
import threading

# Module-wide, not per thread: the async trainer traces its sampler's programs in another thread.
_LOGS: list = []
_LOCK = threading.Lock()


def record(point: str, choice: str) -> None:
  """Notes that dispatch point `point` (e.g. "attention") resolved to `choice` (e.g. "cudnn")."""
  with _LOCK:
    for log in _LOGS:
      log[point][choice] += 1


@contextlib.contextmanager
def recording():
  """Yields {point: Counter(choice -> times traced)} filled by the traces run inside the block."""
  log = collections.defaultdict(collections.Counter)
  with _LOCK:
    _LOGS.append(log)
  try:
    yield log
  finally:
    with _LOCK:
      _LOGS.remove(log)


def describe(**fields) -> str:
  """A hashable record of a call's inputs, `key=value` pairs in order (`parse` reads it back)."""
  return " ".join(f"{k}={v}" for k, v in fields.items())


def parse(text: str) -> dict:
  """`describe`'s fields: ints and booleans as such, the rest strings."""
  out = {}
  for item in text.split(" "):
    key, _, val = item.partition("=")
    out[key] = {"True": True, "False": False}.get(val, int(val) if val.lstrip("-").isdigit() else val)
  return out
