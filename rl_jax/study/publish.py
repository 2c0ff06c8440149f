"""Copies a finished study's verdict, table and a small copy of its figure into the repository's docs.

  python -m rl_jax.study STUDY --root ROOT --publish docs/results

writes docs/results/STUDY/{verdict.md, table.md, figure.png} and, for a study with a protocol, its
per-seed table (per_seed.csv / .json), contrasts.json and protocol.json. The figure is downscaled to at most
`MAX_WIDTH` pixels and stored as a palette PNG, so that a committed study costs ~100-300 KB rather
than the megabyte of the full-resolution figure the runner leaves in ROOT.

The runner's verdict.md ends in a placeholder `## Verdict` section for a person to write. When
OUT/STUDY/verdict.md already has a written one, publishing again (e.g. after more seeds finished)
keeps that text in place of the placeholder and says so: re-read it against the new numbers.
"""
from __future__ import annotations

import os
import shutil

from PIL import Image

MAX_WIDTH = 1800
FILES = ("verdict.md", "table.md")
# Written by a protocol study's analysis (rl_jax/study/verdicts.py): published when present.
PROTOCOL_FILES = ("per_seed.csv", "per_seed.json", "contrasts.json", "protocol.json", "dose_response.md")
# Extra figures a study's analysis may draw (rl_jax/study/dose_figure.py): published small when present.
EXTRA_FIGURES = ("dose_response.png",)
VERDICT_HEADING = "## Verdict"
PLACEHOLDER = "Not yet written"


def written_verdict(text: str) -> str | None:
  """The body of a verdict.md's `## Verdict` section, or None when it is absent or the placeholder."""
  head, sep, body = text.partition("\n" + VERDICT_HEADING + "\n")
  body = body.strip()
  return body if sep and body and not body.startswith(PLACEHOLDER) else None


def merge_verdict(new: str, old: str | None) -> tuple[str, bool]:
  """`new` with its placeholder verdict replaced by `old`'s written one, if any; (text, kept?)."""
  kept = written_verdict(old) if old else None
  if kept is None:
    return new, False
  head, sep, _ = new.partition("\n" + VERDICT_HEADING + "\n")
  if not sep:
    return new, False
  return head + sep + "\n" + kept + "\n", True


def small_png(src: str, dst: str, max_width: int = MAX_WIDTH, colors: int = 128) -> None:
  with Image.open(src) as im:
    im = im.convert("RGB")
    if im.width > max_width:
      im = im.resize((max_width, round(im.height * max_width / im.width)), Image.LANCZOS)
    im.quantize(colors=colors, method=Image.Quantize.MEDIANCUT).save(dst, optimize=True)


def publish(root: str, study: str, out: str) -> dict[str, str]:
  """Copies ROOT's verdict.md and table.md and a small figure.png to OUT/STUDY; returns the paths."""
  missing = [f for f in FILES + ("figure.png",) if not os.path.exists(os.path.join(root, f))]
  if missing:
    raise FileNotFoundError(f"study {study!r}: {root} has no {', '.join(missing)} (aggregate it first)")
  dst = os.path.join(out, study)
  os.makedirs(dst, exist_ok=True)
  paths = {"table.md": shutil.copyfile(os.path.join(root, "table.md"), os.path.join(dst, "table.md"))}
  paths["verdict.md"] = os.path.join(dst, "verdict.md")
  old = open(paths["verdict.md"]).read() if os.path.exists(paths["verdict.md"]) else None
  text, kept = merge_verdict(open(os.path.join(root, "verdict.md")).read(), old)
  with open(paths["verdict.md"], "w") as f:
    f.write(text)
  if kept:
    print(f"[study] kept the written verdict of {paths['verdict.md']}: re-read it against the new numbers")
  paths["figure.png"] = os.path.join(dst, "figure.png")
  small_png(os.path.join(root, "figure.png"), paths["figure.png"])
  for name in PROTOCOL_FILES:
    if os.path.exists(os.path.join(root, name)):
      paths[name] = shutil.copyfile(os.path.join(root, name), os.path.join(dst, name))
  for name in EXTRA_FIGURES:
    if os.path.exists(os.path.join(root, name)):
      paths[name] = os.path.join(dst, name)
      small_png(os.path.join(root, name), paths[name])
  return paths
