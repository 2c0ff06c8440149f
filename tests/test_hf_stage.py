"""Staging a remote HF checkpoint into the host-local cache: complete, reused, redone when stale or interrupted."""
import os

import pytest
from etils import epath

from rl_jax.config_utils import ConfigError
from rl_jax.models import hf_stage


@pytest.fixture
def remote(tmp_path, monkeypatch):
  """A directory the stager treats as remote (no object store here: the copy path is the same)."""
  src = tmp_path / "bucket" / "ckpt"
  src.mkdir(parents=True)
  (src / "config.json").write_text('{"model_type": "qwen3"}')
  (src / "model.safetensors").write_bytes(os.urandom(4096))
  (src / "tokenizer.json").write_text("{}")
  (src / "sub").mkdir()  # subdirectories are not part of a checkpoint: not copied
  monkeypatch.setattr(hf_stage.wd, "is_local", lambda path: False)
  copies = []
  cls = type(epath.Path(str(src)))  # the concrete backend class whose copy the stager calls
  real_copy = cls.copy
  monkeypatch.setattr(cls, "copy", lambda self, dst, overwrite=False: copies.append(self.name)
                      or real_copy(self, dst, overwrite=overwrite))
  return src, copies, str(tmp_path / "cache")


def test_remote_checkpoint_is_copied_whole_once(remote):
  src, copies, cache = remote
  dest = hf_stage.local_checkpoint(str(src), cache_dir=cache)
  assert os.path.dirname(dest) == cache
  assert sorted(os.listdir(dest)) == sorted(["config.json", "model.safetensors", "tokenizer.json",
                                             hf_stage.MANIFEST])
  for name in ("config.json", "model.safetensors", "tokenizer.json"):
    assert (src / name).read_bytes() == open(os.path.join(dest, name), "rb").read()
  assert sorted(copies) == ["config.json", "model.safetensors", "tokenizer.json"]
  assert hf_stage.local_checkpoint(str(src), cache_dir=cache) == dest
  assert len(copies) == 3  # the second call reused the complete copy


def test_changed_or_interrupted_staging_is_redone(remote):
  src, copies, cache = remote
  dest = hf_stage.local_checkpoint(str(src), cache_dir=cache)
  (src / "model.safetensors").write_bytes(os.urandom(8192))  # a new version of the weights
  assert hf_stage.local_checkpoint(str(src), cache_dir=cache) == dest
  assert open(os.path.join(dest, "model.safetensors"), "rb").read() == (src / "model.safetensors").read_bytes()
  os.remove(os.path.join(dest, hf_stage.MANIFEST))  # as if the process died before the manifest
  n = len(copies)
  hf_stage.local_checkpoint(str(src), cache_dir=cache)
  assert len(copies) == n + 3


def test_empty_remote_directory_names_the_key(remote, tmp_path):
  empty = tmp_path / "bucket" / "empty"
  empty.mkdir()
  with pytest.raises(ConfigError, match="warm_start.path"):
    hf_stage.local_checkpoint(str(empty), cache_dir=remote[2])


def test_local_path_is_used_in_place(tmp_path):
  assert hf_stage.local_checkpoint(str(tmp_path)) == str(tmp_path)
