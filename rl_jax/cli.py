"""Expected command-line failures as one stderr line and an exit code: 2 config, 3 run, 75 preempted."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import traceback
from typing import NoReturn

from rl_jax import artifacts

# Exit codes (rl_jax/artifacts.py; 75 is rl_jax/preempt.py's PREEMPTED_EXIT_CODE, not imported here
# because preempt imports jax). argparse's own usage errors exit 2 too, with the usage.
CONFIG_ERROR, RUN_ERROR, PREEMPTED = artifacts.CONFIG_ERROR, artifacts.RUN_ERROR, 75
# RL_JAX_TRACEBACK=1 prints the full traceback of an expected failure too.
TRACEBACK_ENV = "RL_JAX_TRACEBACK"

# A bad path the user gave (a workdir, root or output that is missing, a file, or not writable).
PATH_ERRORS = (FileNotFoundError, NotADirectoryError, IsADirectoryError, FileExistsError, PermissionError)


def fail(code: int, message: str) -> NoReturn:
  """Prints `message` to stderr (and, under RL_JAX_TRACEBACK=1, the exception being handled) and exits."""
  print(message, file=sys.stderr, flush=True)
  if os.environ.get(TRACEBACK_ENV, "") not in ("", "0") and sys.exc_info()[0] is not None:
    traceback.print_exc()
  sys.exit(code)


def unknown_key(key: str, job: str = "rl") -> str:
  """'unknown config key 'a.b' (closest: a.c, a.d)': the message for a mistyped dotted key."""
  from rl_jax import config_schema  # pylint: disable=g-import-not-at-top
  near = config_schema.closest_keys(key, job)
  return f"unknown config key {key!r}" + (f" (closest: {', '.join(near)})" if near else "")


def schema_has(key: str, job: str = "rl") -> bool | None:
  """Whether the job's schema has the field `section.field` (registry-owned ones included); None for a
  key outside its sections, which the job's own validation judges."""
  from rl_jax import config_schema  # pylint: disable=g-import-not-at-top
  section, _, field = key.partition(".")
  cls = config_schema.sections(job).get(section)
  if cls is None or not field or "." in field:
    return None
  return field in {f.name for f in dataclasses.fields(cls)} | set(getattr(cls, "registry_fields", dict)())


# Expected failures by (module, class): looked up only in modules already imported, since an
# exception of a class exists only once its module is loaded (rl_jax.preempt would load jax).
CONFIG_ERRORS = (("rl_jax.config_utils", "ConfigError"), ("rl_jax.workdir", "LockHeldError"),
                 ("rl_jax.analysis.runs", "MixedGroupError"))
PREEMPTED_ERROR = ("rl_jax.preempt", "Preempted")


def _is(e: BaseException, module: str, name: str) -> bool:
  cls = getattr(sys.modules.get(module), name, None)
  return cls is not None and isinstance(e, cls)


def classify(e: BaseException) -> tuple[int, str] | None:
  """(exit code, one-line message) of an expected failure; None for anything else, a bug, whose
  traceback should show."""
  if isinstance(e, SystemExit):
    # `raise SystemExit("--flag: what is wrong")` (rl_jax.plan's idiom) would exit 1; an int code
    # (argparse's usage error, a main's return value) is left alone.
    return (CONFIG_ERROR, f"error: {e.code}") if isinstance(e.code, str) else None
  if _is(e, *PREEMPTED_ERROR):
    return PREEMPTED, str(e)
  if isinstance(e, FloatingPointError):
    return RUN_ERROR, f"run error: {e}"
  if isinstance(e, PATH_ERRORS) or any(_is(e, *c) for c in CONFIG_ERRORS):
    return CONFIG_ERROR, f"error: {e}"
  return None


@contextlib.contextmanager
def expected_errors(prog: str):
  """Turns an expected failure inside the block (or the decorated function) into one line
  '`prog`: error: ...' on stderr and its exit code; anything else propagates unchanged."""
  try:
    yield
  except (Exception, SystemExit) as e:  # pylint: disable=broad-except
    found = classify(e)
    if found is None:
      raise
    fail(found[0], f"{prog}: {found[1]}")
