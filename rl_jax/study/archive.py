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
import os
import tarfile
from typing import Any

from rl_jax.study import runner

# A finished run's records: the runner's labels, commit and protocol digest (study.json), the
# trainer's run record and summary (the runner reads `steps` there: the run is done), every logged
# metric, and failed.json for a run that aborted on a non-finite loss (a finished collapse).
FILES = ("study.json", "run.json", "summary.json", "metrics.jsonl", "failed.json")


def pack(plan: runner.Plan, out_path: str) -> dict[str, int]:
  """Writes the plan's warm start and finished runs under ROOT-relative paths to `out_path`
  (tar.gz); returns {'runs': packed, 'left': unfinished}. Refuses a plan whose warm start is not done."""
  if runner.status(plan.warm_start) != "done":
    raise FileNotFoundError(f"{plan.warm_start.workdir}: the study's warm start is not finished; nothing to pack")
  root = plan.root
  packed, left = 0, 0
  os.makedirs(os.path.dirname(os.path.abspath(out_path)) or ".", exist_ok=True)
  tmp = out_path + ".tmp"
  with tarfile.open(tmp, "w:gz") as tar:
    tar.add(plan.warm_start.workdir, arcname=os.path.relpath(plan.warm_start.workdir, root))
    for launch in plan.launches:
      if runner.status(launch) not in ("done", "collapsed"):
        left += 1
        continue
      for name in FILES:
        path = os.path.join(launch.workdir, name)
        if os.path.exists(path):
          tar.add(path, arcname=os.path.relpath(path, root))
      packed += 1
    note = f"study {plan.study.name}: {packed} finished runs, {left} left\n".encode()
    info = tarfile.TarInfo("ARCHIVE.txt")
    info.size = len(note)
    tar.addfile(info, io.BytesIO(note))
  os.replace(tmp, out_path)  # a failed pack never leaves a truncated archive under the final name
  return {"runs": packed, "left": left}


def unpack(archive: str, root: str) -> list[str]:
  """Extracts `archive` under `root`; a file that exists there with other contents is an error
  (two machines ran the same run: which one counts is the user's decision). Returns the members."""
  if not os.path.exists(archive):
    raise FileNotFoundError(f"{archive}: no such study archive")
  root = os.path.abspath(root)
  with tarfile.open(archive, "r:gz") as tar:
    members = [m for m in tar.getmembers() if m.name != "ARCHIVE.txt"]
    clashes = []
    for m in members:
      dest = os.path.join(root, m.name)
      if m.isfile() and os.path.exists(dest):
        f = tar.extractfile(m)
        if f is not None and open(dest, "rb").read() != f.read():
          clashes.append(m.name)
    if clashes:
      raise FileExistsError(f"{root}: {len(clashes)} files differ from {archive}'s (e.g. {clashes[0]}); "
                            "unpack into an empty ROOT or remove them")
    tar.extractall(root, members=members, filter="data")
  return [m.name for m in members]
