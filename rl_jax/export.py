"""`python -m rl_jax.export --workdir=W [--step=N] --out=DIR`: a run's policy as a Hugging Face checkpoint.

What DIR gets:
- `config.json`: the source checkpoint's own (`warm_start.source=hf`), every key kept, with only the
  keys the run changed set anew (those where the run's model maps to another value than the source's,
  and the dtype the tensors are written in); a run without an HF source gets its family's config.json
  with the sampler's eos / pad ids.
- `generation_config.json`, the tokenizer files and the chat template: copied from the source checkpoint
  (else from `task.overrides.tokenizer`); without a generation config there, one with the run's eos /
  pad ids is written.
- the policy's parameters at step N (default: the newest checkpoint), as safetensors shards of at most
  `--max_shard_gb` with their index (the hub's layout, per-expert MoE tensors).

The run's stored config (`<workdir>/run.json`) says what the model is and where it started; the export
reads the `params` item of the checkpoint only, onto this host's first device (a 30B model in bfloat16
fits one 80 GB GPU; the host needs no more than one parameter's bytes at a time to write it). The
workdir may be remote (gs://, s3://); DIR is a local directory.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from typing import Any, Mapping

import jax
from flax import nnx

from rl_jax import cli
from rl_jax import train_state
from rl_jax import workdir as wd
from rl_jax.checkpoint import Checkpointer
from rl_jax.config_utils import from_dict
from rl_jax.models import families
from rl_jax.models import hf
from rl_jax.models import hf_stage
from rl_jax.models.config import EXECUTION_FIELDS, ModelConfig
from rl_jax.models.safetensors_io import CheckpointError

# Files of a tokenizer directory an HF checkpoint carries (what transformers' save_pretrained writes).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model")
GENERATION_CONFIG = "generation_config.json"
RUN_FILE = "run.json"
# The keys a config.json may spell the checkpoint's dtype with (transformers 4.x / 5.x).
DTYPE_KEYS = ("torch_dtype", "dtype")


class ExportError(ValueError):
  """The workdir or its checkpoint cannot be exported; the message names the file or the flag."""


def carry_config(source: Mapping[str, Any], source_cfg, run_cfg, dtype: str) -> dict:
  """The source's config.json with only what the run changed: each key whose value in the run's
  family mapping (`to_hf`) differs from the source model's, and the dtype the tensors are saved in.

  Keys the mapping does not write (bos / eos ids, max_position_embeddings, layer_types,
  max_window_layers, transformers_version, ...) are the source's, untouched.
  """
  family = families.of(run_cfg)
  before = family.to_hf(source_cfg, dtype)
  after = family.to_hf(run_cfg, dtype)
  out = dict(source)
  for key, value in after.items():
    if key not in DTYPE_KEYS and before.get(key) != value:
      out[key] = value
  present = [k for k in DTYPE_KEYS if k in source]
  for key in present or ["torch_dtype"]:
    out[key] = dtype
  return out


def _read_run(workdir: str) -> dict:
  path = wd.as_path(workdir, "--workdir") / RUN_FILE   # local or remote (gs://), as the run wrote it
  try:
    config = json.loads(path.read_text())["config"]
  except FileNotFoundError:
    raise ExportError(f"--workdir={workdir}: no {RUN_FILE} (not an rl_jax run directory)") from None
  except (json.JSONDecodeError, KeyError, TypeError) as e:
    raise ExportError(f"{path}: not a readable run record ({e})") from None
  if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
    raise ExportError(f"{path}: its config has no 'model' section")
  return config


def _restore_params(workdir: str, model_cfg, step: int | None):
  """(Transformer at `step`, step): the checkpoint's `params` item restored onto the first device."""
  graphdef, abstract = train_state.abstract_state(model_cfg)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                        nnx.to_pure_dict(abstract))
  ckpt = Checkpointer(workdir, create=False)   # a reader: nothing is created or moved aside
  try:
    steps = ckpt.manager.all_steps()
    if not steps:
      raise ExportError(f"--workdir={workdir}: no checkpoint in {ckpt.directory}")
    if step is None:
      step = max(steps)
    elif step not in steps:
      raise ExportError(f"--step={step}: no such checkpoint in {ckpt.directory} (steps: {sorted(steps)})")
    items, _, step = ckpt.restore({"params": target}, step=step)
  finally:
    ckpt.close()
  return nnx.merge(graphdef, items["params"]), step


def _source_dir(config: dict) -> str | None:
  """The local copy of the HF checkpoint the run started from (None: it started elsewhere)."""
  ws = config.get("warm_start") or {}
  if ws.get("source") != "hf" or not ws.get("path"):
    return None
  return hf_stage.local_checkpoint(ws["path"])


def export(workdir: str, out: str, step: int | None = None, *, dtype: str | None = None,
           max_shard_bytes: int | None = None, overwrite: bool = False) -> dict:
  """Writes the run's policy at `step` (default: its newest checkpoint) to `out` as an HF checkpoint.

  Returns a summary: step, source, dtype, written files, the config keys the run changed.
  """
  config = _read_run(workdir)
  run_cfg = from_dict(ModelConfig, config["model"], prefix="model")
  dtype = dtype or run_cfg.param_dtype
  if dtype not in hf.DTYPE_TO_ST:
    raise ExportError(f"--dtype={dtype}: not one of {sorted(hf.DTYPE_TO_ST)}")
  if os.path.exists(out) and os.listdir(out) and not overwrite:
    raise ExportError(f"--out={out}: exists and is not empty (pass --overwrite to replace its files)")
  source = _source_dir(config)
  sampler = config.get("sampler") or {}
  if source is not None:
    source_json = hf.read_json(os.path.join(source, hf.CONFIG_FILE))
    source_cfg = hf.hf_to_model_config(source_json, where=os.path.join(source, hf.CONFIG_FILE),
                                       **{f: getattr(run_cfg, f) for f in EXECUTION_FIELDS})
    hf_config = carry_config(source_json, source_cfg, run_cfg, dtype)
    tokenizer_dir = source
  else:
    # The ids the run's sampler stopped and padded with: a server needs the same.
    ids = {"eos_token_id": sampler.get("eos_id"), "pad_token_id": sampler.get("pad_id")}
    hf_config = hf.model_config_to_hf(run_cfg, dtype=dtype, extra={k: v for k, v in ids.items() if v is not None})
    tokenizer_dir = ((config.get("task") or {}).get("overrides") or {}).get("tokenizer") or None
  model, step = _restore_params(workdir, run_cfg, step)
  os.makedirs(out, exist_ok=True)
  written = hf.save_hf_checkpoint(model, out, dtype=dtype, config=hf_config, overwrite=True,
                                  **({"max_shard_bytes": max_shard_bytes} if max_shard_bytes else {}))
  copied = []
  if tokenizer_dir:
    for name in TOKENIZER_FILES + ((GENERATION_CONFIG,) if source else ()):
      if os.path.isfile(os.path.join(tokenizer_dir, name)):
        shutil.copyfile(os.path.join(tokenizer_dir, name), os.path.join(out, name))
        copied.append(name)
  if GENERATION_CONFIG not in copied:
    gen = {k: hf_config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in hf_config}
    with open(os.path.join(out, GENERATION_CONFIG), "w") as f:
      json.dump(gen, f, indent=2)
    written.append(GENERATION_CONFIG)
  changed = sorted(k for k in hf_config if source_json.get(k) != hf_config[k]) if source else None
  return {"step": step, "source": source, "dtype": dtype, "files": written + copied, "changed": changed}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m rl_jax.export", description=__doc__.split("\n")[0])
  p.add_argument("--workdir", required=True, help="the run's directory (run.json, checkpoints/)")
  p.add_argument("--out", required=True, help="the HF checkpoint directory to write")
  p.add_argument("--step", type=int, default=None, help="the checkpoint step (default: the newest)")
  p.add_argument("--dtype", default=None, help="float32 / bfloat16 (default: the run's param_dtype)")
  p.add_argument("--max_shard_gb", type=float, default=5.0, help="largest safetensors file, GiB")
  p.add_argument("--overwrite", action="store_true", help="write into a non-empty --out")
  args = p.parse_args(argv)
  with cli.expected_errors("python -m rl_jax.export"):
    try:
      summary = export(args.workdir, args.out, args.step, dtype=args.dtype,
                       max_shard_bytes=int(args.max_shard_gb * 2**30), overwrite=args.overwrite)
    except (ExportError, CheckpointError) as e:
      raise SystemExit(str(e)) from None
  what = (f"config.json of {summary['source']} with the run's {summary['changed']}" if summary["source"]
          else "config.json from the model config")
  print(f"[export] step {summary['step']} of {args.workdir} -> {args.out} ({summary['dtype']}): "
        f"{len(summary['files'])} files; {what}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
