"""A study carried across machines: its finished runs and shared warm start packed into one tar.gz, and back.

A protocol study of ~180 CPU runs outlives the machine that started it. `pack` writes the shared
warm start (its checkpoint, so that the runs still to come start from the same weights bit for bit)
and every finished run's records (`FILES`: enough for the runner to skip it and for the analysis to
score it); `unpack` puts them under another ROOT, where `python -m rl_jax.study NAME --root ROOT`
runs only what is left. Unfinished runs are not packed: their checkpoints are large and a fresh
start of a run costs at most one run's time.
"""
from __future__ import annotations

import io
import json
import os
import tarfile

from rl_jax.study import runner

# A finished run's records: the runner's labels, commit and protocol digest (study.json), the
# trainer's run record and summary (the runner reads `steps` there: the run is done), every logged
# metric, and failed.json for a run that aborted on a non-finite loss (a finished collapse).
FILES = ("study.json", "run.json", "summary.json", "metrics.jsonl", "failed.json")
METRICS = "metrics.jsonl"
# `compact`: the metrics.jsonl columns every analysis of the project reads (the protocol's scores, the
# study tables and figures, the collapse predictors); the other ~40 columns (per-method loss internals,
# the other mismatch meters, timings, async bookkeeping) are ~80% of the file and are dropped.
COMPACT_PREFIXES = ("eval_",)
COMPACT_KEYS = ("step", "reward", "accuracy", "response_length", "loss/entropy", "loss/is_ess", "loss/grad_norm",
                "mismatch/kl_k1", "mismatch/kl_k3", "mismatch/routing_agreement", "drift/tv_mean",
                "first_order/cosine", "first_order/norm_ratio", "loss/seq_frac_dropped", "loss/seq_frac_rejected")


def compact_row(row: dict) -> dict:
  """One metrics.jsonl row cut to the columns the analyses read (`COMPACT_PREFIXES`, `COMPACT_KEYS`)."""
  return {k: v for k, v in row.items() if k in COMPACT_KEYS or k.startswith(COMPACT_PREFIXES)}


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
  info = tarfile.TarInfo(name)
  info.size = len(data)
  tar.addfile(info, io.BytesIO(data))


def archived_runs(archives) -> tuple[set[str], bool]:
  """(the run directories, ROOT-relative, that `archives` hold; whether one of them holds the warm start)."""
  runs, warm = set(), False
  for path in archives:
    with tarfile.open(path, "r:gz") as tar:
      for name in tar.getnames():
        if name.endswith("/summary.json") or name.endswith("/failed.json"):
          runs.add(os.path.dirname(name))
        warm |= name.startswith("warm_start/")
  return runs, warm


def pack(plan: runner.Plan, out_path: str, compact: bool = False, after: tuple[str, ...] = ()) -> dict[str, int]:
  """Writes the plan's warm start and finished runs under ROOT-relative paths to `out_path` (tar.gz);
  returns {'runs': packed, 'left': unfinished, 'skipped': already in `after`}.

  `compact`: metrics.jsonl cut to `compact_row`. `after`: earlier archives of the same study (parts
  unpacked before this one): their runs, and the warm start if one holds it, are not packed again.
  Refuses a plan whose warm start is not done."""
  if runner.status(plan.warm_start) != "done":
    raise FileNotFoundError(f"{plan.warm_start.workdir}: the study's warm start is not finished; nothing to pack")
  root = plan.root
  earlier, warm_packed = archived_runs(after)
  packed, left, skipped = 0, 0, 0
  os.makedirs(os.path.dirname(os.path.abspath(out_path)) or ".", exist_ok=True)
  tmp = out_path + ".tmp"
  with tarfile.open(tmp, "w:gz") as tar:
    if not warm_packed:
      tar.add(plan.warm_start.workdir, arcname=os.path.relpath(plan.warm_start.workdir, root))
    for launch in plan.launches:
      rel = os.path.relpath(launch.workdir, root)
      if runner.status(launch) not in ("done", "collapsed"):
        left += 1
        continue
      if rel in earlier:
        skipped += 1
        continue
      for name in FILES:
        path = os.path.join(launch.workdir, name)
        if not os.path.exists(path):
          continue
        if compact and name == METRICS:
          with open(path) as f:
            rows = [compact_row(json.loads(line)) for line in f if line.strip()]
          _add_bytes(tar, os.path.join(rel, name), "".join(json.dumps(r) + "\n" for r in rows).encode())
        else:
          tar.add(path, arcname=os.path.join(rel, name))
      packed += 1
    _add_bytes(tar, "ARCHIVE.txt", (f"study {plan.study.name}: {packed} finished runs"
                                    f"{' (metrics compacted)' if compact else ''}, {skipped} in earlier parts, "
                                    f"{left} left\n").encode())
  os.replace(tmp, out_path)  # a failed pack never leaves a truncated archive under the final name
  return {"runs": packed, "left": left, "skipped": skipped}


def unpack(archive: str, root: str) -> list[str]:
  """Extracts `archive` under `root`; a file that exists there with other contents is an error
  (two machines ran the same run: which one counts is the user's decision). Returns the members."""
  if not os.path.exists(archive):
    raise FileNotFoundError(f"{archive}: no such study archive")
  root = os.path.abspath(root)
  with tarfile.open(archive, "r:gz") as tar:
    members = [m for m in tar.getmembers() if m.name != "ARCHIVE.txt"]
    bad = [m.name for m in members if os.path.isabs(m.name) or ".." in m.name.split("/")
           or not (m.isfile() or m.isdir())]
    if bad:
      raise ValueError(f"{archive}: not a study archive (member {bad[0]!r} is outside ROOT or not a plain file)")
    clashes = []
    for m in members:
      dest = os.path.join(root, m.name)
      if m.isfile() and os.path.exists(dest):
        with open(dest, "rb") as have, tar.extractfile(m) as want:
          if have.read() != want.read():
            clashes.append(m.name)
    if clashes:
      raise FileExistsError(f"{root}: {len(clashes)} files differ from {archive}'s (e.g. {clashes[0]}); "
                            "unpack into an empty ROOT or remove them")
    # tarfile's own "data" filter as well where it exists (Python >= 3.11.4; 3.12 warns without one).
    tar.extractall(root, members=members, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
  return [m.name for m in members]
