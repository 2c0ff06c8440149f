"""A remote (gs://, s3://, ...) Hugging Face checkpoint copied once into a host-local cache for the memory-mapped loader."""
from __future__ import annotations

import hashlib
import json
import os

from etils import epath

from rl_jax import workdir as wd
from rl_jax.config_utils import ConfigError

# The loader memory-maps safetensors (models/safetensors_io.py) and so needs local files. A remote
# checkpoint is copied, whole and once per host, to CACHE_ENV (default ~/.cache/rl_jax/hf), under a
# directory named by the URI's hash; a manifest of names, sizes and mtimes written last marks a complete
# copy, so a copy interrupted mid-way is redone and a source whose files changed is copied again.
CACHE_ENV = "RL_JAX_HF_CACHE"
MANIFEST = ".rl_jax_staged.json"


def cache_root() -> str:
  return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "rl_jax", "hf")


def _manifest(root: epath.Path) -> dict[str, list[int]]:
  """{file name: [size, mtime]} of the directory's regular files."""
  out = {}
  for p in sorted(root.iterdir()):
    if p.is_file():
      st = p.stat()
      out[p.name] = [int(st.length), int(st.mtime)]
  return out


def local_checkpoint(path: str, key: str = "warm_start.path", cache_dir: str | None = None) -> str:
  """`path` itself when it is local, else a complete host-local copy of its files (made on first use).

  Every regular file of the directory is copied (config, safetensors shards and index, tokenizer
  files; subdirectories are not). Each file goes to a temporary name and is renamed into place, so
  several processes on one host may stage the same checkpoint at once.
  """
  root = wd.as_path(path, key)
  if wd.is_local(root):
    return os.fspath(root)
  want = _manifest(root)
  if not want:
    raise ConfigError(f"config key '{key}': {root} holds no files")
  dest = os.path.join(cache_dir or cache_root(), hashlib.sha1(os.fspath(root).encode()).hexdigest()[:16])
  done = os.path.join(dest, MANIFEST)
  if os.path.exists(done):
    with open(done) as f:
      if json.load(f).get("files") == want:
        return dest
  os.makedirs(dest, exist_ok=True)
  total = sum(size for size, _ in want.values())
  print(f"[hf] staging {root} ({len(want)} files, {total / 2**30:.2f} GiB) to {dest}", flush=True)
  for name, (size, _) in want.items():
    target = os.path.join(dest, name)
    tmp = f"{target}.tmp{os.getpid()}"
    (root / name).copy(epath.Path(tmp), overwrite=True)
    if os.path.getsize(tmp) != size:
      raise OSError(f"staging {root / name}: copied {os.path.getsize(tmp)} bytes, expected {size}")
    os.replace(tmp, target)
  tmp = f"{done}.tmp{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump({"source": os.fspath(root), "files": want}, f, indent=1)
  os.replace(tmp, done)
  return dest
