"""Copies a finished study's verdict, table and a small copy of its figure into the repository's docs.

  python -m rl_jax.study STUDY --root ROOT --publish docs/results

writes docs/results/STUDY/{verdict.md, table.md, figure.png}. The figure is downscaled to at most
`MAX_WIDTH` pixels and stored as a palette PNG, so that a committed study costs ~100-300 KB rather
than the megabyte of the full-resolution figure the runner leaves in ROOT.
"""
from __future__ import annotations

import os
import shutil

from PIL import Image

MAX_WIDTH = 1800
FILES = ("verdict.md", "table.md")


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
  paths = {}
  for f in FILES:
    paths[f] = shutil.copyfile(os.path.join(root, f), os.path.join(dst, f))
  paths["figure.png"] = os.path.join(dst, "figure.png")
  small_png(os.path.join(root, "figure.png"), paths["figure.png"])
  return paths
