"""Run directory: one path abstraction (etils epath), a one-writer lock, the run identity and the stored config."""
from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import socket
import time
import uuid
from typing import Any, Iterable, Literal

from etils import epath

from rl_jax import artifacts
from rl_jax.config_utils import ConfigError

# Schemes etils epath routes to a remote backend. Anything else with '://' would silently become a
# local directory named e.g. './memory:/x', so it is refused.
REMOTE_SCHEMES = ("gs", "s3", "az", "hf")

LOCK_NAME = "workdir.lock"
RUN_NAME = artifacts.RUN

# Keys that may differ between the stored config and a resumed run's without `resume='force'`:
# run length, cadences and logging, which change what is recorded or when, not what is computed.
# Caveat: with `optim.total_steps=0` the RL cosine schedule spans `rl.steps`, so extending a run
# also stretches the remaining learning-rate decay (the usual meaning of "train longer").
SAFE_TO_CHANGE = frozenset({
    "rl.steps", "rl.eval_every", "rl.checkpoint_every", "rl.max_to_keep", "rl.plot",
    "sft.steps", "sft.eval_every", "sft.checkpoint_every", "sft.max_to_keep",
    "resume",
})
SAFE_PREFIXES = ("logging.",)

Resume = Literal["check", "force"]


def as_path(workdir: Any, key: str = "workdir") -> epath.Path:
  """The epath for a workdir string: remote URIs kept as they are, local paths made absolute.

  Raises ConfigError naming `key` for an empty path or a scheme epath cannot route.
  """
  s = os.fspath(workdir) if not isinstance(workdir, str) else workdir
  if not s:
    raise ConfigError(f"config key '{key}': empty path")
  if "://" in s:
    scheme = s.split("://", 1)[0]
    if scheme not in REMOTE_SCHEMES:
      raise ConfigError(f"config key '{key}': scheme '{scheme}://' in {s!r} is not supported "
                        f"(local paths or {', '.join(x + '://' for x in REMOTE_SCHEMES)})")
    return epath.Path(s)
  return epath.Path(os.path.abspath(os.path.expanduser(s)))


def is_local(path: epath.Path) -> bool:
  return "://" not in os.fspath(path)


def write_atomic(path: epath.Path, text: str) -> None:
  """Writes `text` to a temporary sibling and renames it over `path` (readers see old or new, whole)."""
  tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
  tmp.write_text(text)
  tmp.replace(path)


def _now() -> str:
  return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _proc_start(pid: int) -> str | None:
  """Linux: the process's start time in clock ticks since boot (field 22 of /proc/<pid>/stat)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[19]
  except (OSError, IndexError):
    return None


def _boot_id() -> str | None:
  try:
    with open("/proc/sys/kernel/random/boot_id") as f:
      return f.read().strip()
  except OSError:
    return None


# Lock files this process holds: a holder record with our own pid is stale unless listed here
# (a restarted container often reuses the dead process's pid).
_HELD: set[str] = set()


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # exists, owned by someone else
    return True
  return True


class LockHeldError(RuntimeError):
  """Another live process holds the workdir lock."""


@dataclasses.dataclass
class WorkdirLock:
  """One writer per workdir: `<workdir>/workdir.lock` holds {host, pid, time, token}.

  Local paths: created with O_CREAT|O_EXCL, so of two processes racing exactly one wins. A lock
  left by a dead process on this host (its pid is gone) is taken over with a message: the stale
  file is renamed aside (atomic; of two takers one gets it), checked to be the file that was read,
  and a fresh one is created with O_EXCL again. A lock from another host cannot be checked for
  liveness and must be removed by hand (the error says which file).
  Remote schemes (gs://, ...): best effort. Object stores have no exclusive create through epath,
  so the lock is written and read back after a short delay; two processes starting within that
  delay can both pass, and a stale remote lock is only taken over when it names this host.
  Liveness on Linux also compares the boot id and the holder's start time, so a pid reused by
  another process (a restarted container) does not keep a dead run's lock; elsewhere a reused
  pid can make a dead holder look alive, and the error names the file to delete.
  """
  path: epath.Path
  token: str = ""

  def acquire(self) -> "WorkdirLock":
    self.token = uuid.uuid4().hex
    if is_local(self.path):
      self._acquire_local()
    else:
      self._acquire_remote()
    return self

  def _record(self) -> dict:
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "time": _now(), "token": self.token,
            "start": _proc_start(pid), "boot": _boot_id()}

  def _held_error(self, holder: dict) -> LockHeldError:
    return LockHeldError(
        f"workdir is in use: {self.path} is held by host {holder.get('host')!r} pid "
        f"{holder.get('pid')} (since {holder.get('time')}); one process writes a workdir at a time. "
        f"If that process is gone, delete {self.path}")

  def _is_stale(self, holder: dict) -> bool:
    """Same host and the holder is gone: its pid is not running, or is a different process now
    (another boot, another start time; a reused pid, e.g. a restarted container)."""
    pid = holder.get("pid")
    if holder.get("host") != socket.gethostname() or not isinstance(pid, int):
      return False
    if pid == os.getpid():
      return os.fspath(self.path) not in _HELD
    if not _pid_alive(pid):
      return True
    if holder.get("boot") and holder["boot"] != _boot_id():
      return True
    return bool(holder.get("start")) and holder["start"] != _proc_start(pid)

  def _acquire_local(self) -> None:
    path = os.fspath(self.path)
    for _ in range(3):
      try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
      except FileExistsError:
        holder = _read_json(self.path)
        if not self._is_stale(holder):
          raise self._held_error(holder) from None
        aside = f"{path}.stale-{uuid.uuid4().hex[:8]}"
        try:
          os.rename(path, aside)
        except FileNotFoundError:
          continue  # another taker moved it first; race for the O_EXCL create
        moved = _read_json(epath.Path(aside))
        if moved.get("token") != holder.get("token"):
          # We moved a lock someone created after reading the stale one: put it back.
          try:
            os.link(aside, path)
          finally:
            os.unlink(aside)
          raise self._held_error(moved)
        os.unlink(aside)
        print(f"[workdir] taking over a stale lock {path}: host {holder.get('host')!r} pid "
              f"{holder.get('pid')} (since {holder.get('time')}) is gone")
        continue
      with os.fdopen(fd, "w") as f:
        json.dump(self._record(), f)
      _HELD.add(path)
      return
    raise self._held_error(_read_json(self.path))

  def _acquire_remote(self, settle_s: float = 0.5) -> None:
    if self.path.exists():
      holder = _read_json(self.path)
      if not self._is_stale(holder):
        raise self._held_error(holder)
      print(f"[workdir] taking over a stale lock {self.path}: host {holder.get('host')!r} pid "
            f"{holder.get('pid')} is gone")
    self.path.write_text(json.dumps(self._record()))
    time.sleep(settle_s)
    holder = _read_json(self.path)
    if holder.get("token") != self.token:
      raise self._held_error(holder)
    _HELD.add(os.fspath(self.path))

  def release(self) -> None:
    """Removes the lock if it is still ours (never someone else's)."""
    if self.token and self.path.exists() and _read_json(self.path).get("token") == self.token:
      self.path.unlink(missing_ok=True)
    if self.token:
      _HELD.discard(os.fspath(self.path))
    self.token = ""


def _read_json(path: epath.Path) -> dict:
  """A lock or run file, {} when absent or torn (another process may be writing it)."""
  try:
    return json.loads(path.read_text())
  except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
    return {}


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
  """Nested dicts -> {'a.b': leaf}; tuples become lists so a JSON round trip compares equal."""
  if isinstance(tree, dict):
    out = {}
    for k, v in tree.items():
      out.update(flatten(v, f"{prefix}{k}."))
    if not tree and prefix:
      out[prefix[:-1]] = {}
    return out
  return {prefix[:-1]: json.loads(json.dumps(tree, default=str))}


def is_safe_key(key: str, safe: Iterable[str] = SAFE_TO_CHANGE) -> bool:
  return key in safe or key.startswith(SAFE_PREFIXES)


def config_diff(stored: dict, new: dict, defaults: dict | None = None) -> list[tuple[str, Any, Any]]:
  """(key, stored value, new value) for every differing flattened key; a missing side is '<absent>'.

  A key one side leaves out and the other sets to its schema default (`defaults`, flattened) is no
  difference: a config written before that key was listed means the same run.
  """
  a, b = flatten(stored), flatten(new)
  missing = "<absent>"
  defaults = defaults or {}
  a = {**{k: v for k, v in defaults.items() if k in b}, **a}
  b = {**{k: v for k, v in defaults.items() if k in a}, **b}
  return [(k, a.get(k, missing), b.get(k, missing)) for k in sorted(a.keys() | b.keys())
          if a.get(k, missing) != b.get(k, missing)]


def check_config(stored: dict, new: dict, resume: str = "check",
                 defaults: dict | None = None) -> list[tuple[str, Any, Any]]:
  """Raises ConfigError listing the unsafe differences unless resume='force'; returns all differences."""
  if resume not in ("check", "force"):
    raise ConfigError(f"config key 'resume': {resume!r} is not one of ['check', 'force']")
  diff = config_diff(stored, new, defaults)
  unsafe = [d for d in diff if not is_safe_key(d[0])]
  if unsafe and resume != "force":
    lines = "\n".join(f"  {k}: {a!r} -> {b!r}" for k, a, b in unsafe)
    raise ConfigError(
        f"config key 'resume': the config differs from the one this workdir was started with in "
        f"{len(unsafe)} key(s):\n{lines}\nUse a new workdir, restore those values, or pass "
        f"--config.resume=force to resume anyway (safe to change: {sorted(SAFE_TO_CHANGE)} and "
        f"{list(SAFE_PREFIXES)}*)")
  return diff


def has_checkpoint(path: epath.Path, subdir: str = "checkpoints") -> bool:
  """Whether `path/subdir` holds a finalized orbax step (a directory named by an integer)."""
  d = path / subdir
  return d.is_dir() and any(p.name.isdigit() and p.is_dir() for p in d.iterdir())


def new_identity() -> dict:
  return {"run_id": uuid.uuid4().hex[:16], "created": _now(), "host": socket.gethostname()}


ENV_PACKAGES = ("jax", "jaxlib", "flax", "optax", "numpy", "ml_dtypes")


def _cpu_model() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def environment() -> dict:
  """What a run's bits depend on beyond its config: package versions, the CPU and XLA's flags.

  Read without importing jax (this runs before any backend starts), so two runs can be checked for
  bit-identity across machines by comparing this record first.
  """
  versions = {}
  for name in ENV_PACKAGES:
    try:
      versions[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      versions[name] = None
  return {"python": platform.python_version(), "packages": versions, "cpu": _cpu_model(),
          "machine": platform.machine(), "cpu_count": os.cpu_count(),
          "xla_flags": os.environ.get("XLA_FLAGS", ""), "jax_platforms": os.environ.get("JAX_PLATFORMS", "")}


@dataclasses.dataclass
class RunDir:
  """An opened workdir: `.path(...)` for files in it, `.identity`, `.config`, `.lock`, `.resuming`.

  `<workdir>/run.json` = {"identity": {run_id, created, host}, "environment": `environment()` at
  creation, "config": resolved config, "history": [{time, host, changed keys and / or the new
  environment} per resume that changed either]}. It is (re)written when a run starts
  with nothing to resume (no checkpoint), so a new experiment in a reused path gets a new
  identity (and wandb run); with a checkpoint the stored config is checked first.
  """
  root: epath.Path
  identity: dict | None
  config: dict
  resuming: bool
  lock: WorkdirLock | None
  changed: list = dataclasses.field(default_factory=list)

  @classmethod
  def open(cls, workdir: Any, config_dict: dict, *, resume: str = "check",
           is_writer: bool = True, subdir: str = "checkpoints",
           defaults: dict | None = None) -> "RunDir":
    """Validates, locks (writer only), and checks or records the config; call before any compute.

    `is_writer`: process 0 of a multi-process job (or the only process). Other processes take no
    lock and write nothing, but run the same config check on the same stored files, so every
    process fails alike. `defaults`: the job's flattened schema defaults (`section.key` -> value,
    e.g. `RLJob.schema_defaults()`), so a key one config leaves out compares as its default; the
    caller passes them, since the schema sits above this module.
    """
    if resume not in ("check", "force"):
      raise ConfigError(f"config key 'resume': {resume!r} is not one of ['check', 'force']")
    root = as_path(workdir)
    if root.exists() and not root.is_dir():
      raise ConfigError(f"config key 'workdir': {root} exists and is not a directory")
    lock = None
    if is_writer:
      try:
        root.mkdir(parents=True, exist_ok=True)
        lock = WorkdirLock(root / LOCK_NAME).acquire()
      except PermissionError as e:
        raise ConfigError(f"config key 'workdir': {root} is not writable ({e})") from None
      except OSError as e:
        raise ConfigError(f"config key 'workdir': cannot create or write {root} ({e})") from None
    try:
      return cls._open_locked(root, config_dict, resume, is_writer, lock, subdir, defaults)
    except BaseException:
      if lock is not None:
        lock.release()
      raise

  @classmethod
  def _open_locked(cls, root, config_dict, resume, is_writer, lock, subdir, defaults) -> "RunDir":
    run_file = root / RUN_NAME
    resuming = has_checkpoint(root, subdir)
    stored = _read_json(run_file) if run_file.exists() else {}
    new = json.loads(json.dumps(config_dict, default=str))
    env = environment()
    if resuming and stored.get("config") is not None:
      diff = check_config(stored["config"], new, resume, defaults)
      identity = stored.get("identity")
      # A resume on another machine or package set is recorded: its steps may differ in the last bit.
      last_env = next((h["environment"] for h in reversed(stored.get("history", [])) if "environment" in h),
                      stored.get("environment"))
      if (diff or env != last_env) and is_writer:
        forced = [k for k, _, _ in diff if not is_safe_key(k)]
        if forced:
          print(f"[workdir] resume='force': resuming with changed keys {forced}")
        entry = {"time": _now(), "host": new_identity()["host"], "changed": [k for k, _, _ in diff]}
        if env != last_env:
          entry["environment"] = env
        record = dict(stored, config=new)
        record["history"] = stored.get("history", []) + [entry]
        write_atomic(run_file, json.dumps(record, indent=1))
      return cls(root, identity, new, True, lock, diff)
    if resuming and is_writer:
      # A checkpoint from before run.json existed: adopt it, recording this config from now on.
      print(f"[workdir] {root} has checkpoints but no {RUN_NAME}: recording the current config")
    identity = new_identity() if is_writer else stored.get("identity")
    if is_writer:
      write_atomic(run_file, json.dumps({"identity": identity, "environment": env, "config": new, "history": []},
                                        indent=1))
    return cls(root, identity, new, resuming, lock)

  def path(self, *parts: str) -> epath.Path:
    return self.root.joinpath(*parts)

  @property
  def run_id(self) -> str | None:
    return self.identity["run_id"] if self.identity else None

  def close(self) -> None:
    if self.lock is not None:
      self.lock.release()
      self.lock = None

  def __enter__(self) -> "RunDir":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
