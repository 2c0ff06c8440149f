"""Study CLI: python -m rl_jax.study STUDY [--root DIR] [--seeds N] [--steps N] [--jobs N] [--panels A,B] [--lines A,B] [--dry_run | --print_commands].

Runs every (run, seed) of a named study on this machine (or prints one launch command per run
for a cluster), skipping finished runs and resuming unfinished ones, then writes
ROOT/figure.png, ROOT/table.{md,csv,json} and ROOT/verdict.md. Without STUDY, lists the studies.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys

from rl_jax import cli
from rl_jax import preempt
from rl_jax.study import archive, dose_figure, publish, runner, studies, verdicts

DEFAULT_ROOT = "/tmp/rl_jax_studies"


def _listing() -> str:
  lines = ["studies:"]
  for s in studies.STUDIES.values():
    tag = "protocol" if s.protocol is not None else "exploratory"
    lines.append(f"  {s.name:22s} {len(s.runs()):3d} runs x {s.seeds:2d} seeds  [{tag}] {s.description}")
  return "\n".join(lines)


def _run_argv(argv: list[str]) -> list[str]:
  """The command line that runs the study: `--aggregate_only` and `--publish DIR` dropped, so a
  verdict written by re-aggregating still names the command that reproduces its runs."""
  out, skip = [], False
  for a in argv:
    if skip:
      skip = False
    elif a == "--aggregate_only" or a.startswith("--publish="):
      pass
    elif a == "--publish":
      skip = True
    else:
      out.append(a)
  return out


@cli.expected_errors("python -m rl_jax.study")
def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="python -m rl_jax.study", description=__doc__.split("\n")[0],
                              epilog=_listing(), formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("study", nargs="?", choices=sorted(studies.STUDIES), metavar="STUDY")
  p.add_argument("--root", default=None, help=f"workdirs root (default {DEFAULT_ROOT}/STUDY)")
  p.add_argument("--seeds", type=int, default=None, help="seeds 0..N-1 (default: the study's)")
  p.add_argument("--steps", type=int, default=None, help="rl.steps of every run (default: the study's)")
  p.add_argument("--jobs", type=int, default=1, help="runs at a time on this machine")
  p.add_argument("--panels", default=None, metavar="A,B",
                 help="only these panels (comma-separated; default: all), e.g. the most telling one first")
  p.add_argument("--lines", default=None, metavar="A,B",
                 help="only these lines (methods; comma-separated; default: all), e.g. more seeds for a few")
  p.add_argument("--dry_run", action="store_true", help="list the runs and the estimated CPU time left")
  p.add_argument("--print_commands", action="store_true", help="print one launch command per run")
  p.add_argument("--aggregate_only", action="store_true", help="only redraw the figure and tables")
  p.add_argument("--launcher", default="", metavar="CMD",
                 help="run every run through CMD (which runs `python -m rl_jax.main ARGS`), e.g. "
                      "'launch/local_multiprocess.sh 2' for 2 processes per run")
  p.add_argument("--wandb_mode", default="disabled", choices=("disabled", "offline", "online"))
  p.add_argument("--allow_mixed", action="store_true",
                 help="aggregate a protocol study whose cells ran at different commits or protocols "
                      "(refused by default; the verdict then names every difference)")
  p.add_argument("--pack", default=None, metavar="FILE",
                 help="only write the warm start and every finished run to FILE (tar.gz), to carry the study "
                      "to another machine")
  p.add_argument("--pack_compact", action="store_true",
                 help="with --pack: keep only the metrics columns the analyses read (archive.COMPACT_*)")
  p.add_argument("--pack_after", default="", metavar="A,B",
                 help="with --pack: earlier archives of this study; their runs (and warm start) are not packed again")
  p.add_argument("--unpack", default=None, metavar="A,B",
                 help="first extract these archives (written by --pack; comma-separated, in order) under ROOT; then "
                      "run what is left as usual")
  p.add_argument("--publish", default=None, metavar="DIR",
                 help="after aggregating, copy verdict.md, table.md and a small figure.png to DIR/STUDY")
  args = p.parse_args(argv)
  if args.jobs < 1:
    p.error(f"--jobs {args.jobs}: must be >= 1")
  if args.study is None:
    print(_listing())
    return 0
  study = studies.get(args.study)
  if args.panels:
    try:
      study = study.only_panels([n for n in args.panels.split(",") if n])
    except KeyError as e:
      p.error(f"--panels: {e.args[0]}")
  if args.lines:
    try:
      study = study.only_lines([n for n in args.lines.split(",") if n])
    except KeyError as e:
      p.error(f"--lines: {e.args[0]}")
  root = args.root or os.path.join(DEFAULT_ROOT, study.name)
  plan = runner.plan(study, root, seeds=args.seeds, steps=args.steps, wandb_mode=args.wandb_mode,
                     launcher=shlex.split(args.launcher))
  if args.unpack:
    for path in [a for a in args.unpack.split(",") if a]:
      try:
        members = archive.unpack(path, plan.root)
      except (FileNotFoundError, FileExistsError) as e:
        p.error(f"--unpack: {e}")
      print(f"[study] unpacked {len(members)} files from {path} under {plan.root}")
  if args.pack:
    try:
      counts = archive.pack(plan, args.pack, compact=args.pack_compact,
                            after=tuple(a for a in args.pack_after.split(",") if a))
    except FileNotFoundError as e:
      p.error(f"--pack: {e}")
    print(f"[study] packed {counts['runs']} finished runs to {args.pack} ({counts['skipped']} in earlier parts, "
          f"{counts['left']} not finished)")
    return 0
  if args.dry_run:
    runner.dry_run(plan)
    return 0
  if args.print_commands:
    runner.print_commands(plan)
    return 0
  command = " ".join(shlex.quote(a) for a in ["python", "-m", "rl_jax.study"] + _run_argv(
      sys.argv[1:] if argv is None else argv))
  rc = 0
  if not args.aggregate_only:
    try:
      counts = runner.run_study(plan, jobs=args.jobs)
    except preempt.Preempted as e:  # the runs in progress checkpointed; rerunning resumes them
      print(f"[study] {study.name}: {e}", file=sys.stderr)
      return preempt.PREEMPTED_EXIT_CODE
    print(f"[study] {study.name}: {counts['ok']} ran, {counts['skipped']} already finished, "
          f"{counts['failed']} failed")
    rc = 1 if counts["failed"] else 0
  try:
    paths = runner.aggregate_study(plan, command, allow_mixed=args.allow_mixed)
  except verdicts.MixedRunsError as e:
    print(f"[study] {study.name}: {e}", file=sys.stderr)
    return 2
  print("[study] wrote " + ", ".join(paths[k] for k in ("png", "md", "csv", "json", "verdict")))
  if study.protocol is not None and study.protocol.rule == "dose_response":
    dose = dose_figure.write(plan.root, f"{study.name}: window mean of held-out greedy accuracy and collapse "
                                        "rate against each mismatch dose (95% t intervals over seeds)")
    print(f"[study] wrote {dose['png']}, {dose['md']}")
  if args.publish:
    published = publish.publish(plan.root, study.name, args.publish)
    print("[study] published " + ", ".join(published.values()))
  return rc


if __name__ == "__main__":
  sys.exit(main())
