"""Runs a study: one shared SFT warm start, then every (run, seed) as a subprocess; skips, resumes, aggregates.

Layout under ROOT: `warm_start/` (the shared SFT checkpoint), `<panel>/<line>/seed<k>/` (one
trainer workdir per run and seed, with the runner's `study.json`, `run.log` and, when the
job exited non-zero, `failed.json`), and the study's `figure.png`, `table.{md,csv,json}` and
`verdict.md`.

A run is finished when its summary.json says it reached its rl.steps, or when it failed on a
non-finite loss (a collapse, recorded as such); any other run is (re)launched, and the trainer
resumes it from its last checkpoint. The executor that runs a launch is injectable (tests
use a fake one); the default runs `python -m rl_jax.main` from the repository root.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import shlex
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Literal, Sequence

import tqdm

from rl_jax import analysis
from rl_jax import artifacts
from rl_jax import preempt
from rl_jax.analysis import aggregate, precursors, runs as runs_lib, tables
from rl_jax.study import protocol as protocol_lib
from rl_jax.study import studies
from rl_jax.study import sweeps
from rl_jax.study import verdicts as verdicts_lib
from rl_jax.study.config import REPO_ROOT, config_file, load_base

CONFIG_FILE = "rl_jax/study/config.py"   # relative to REPO_ROOT, where every launch runs
WARM_START_DONE = "study_warm_start.json"
# CPU cost of one RL step per response (prompts x group) plus a run's start-up (compiles,
# evaluations), from the main job's ~3 min for 160 steps x 256 responses on an idle 2-core
# machine. Used by --dry_run until a finished run in ROOT gives a measured figure.
STEP_S_PER_RESPONSE = 3.7e-3
RUN_OVERHEAD_S = 30.0
WARM_START_S = 60.0
# Runs shorter than this are all start-up (compiles): they do not measure the per-step cost.
MEASURE_MIN_STEPS = 20


@dataclasses.dataclass(frozen=True)
class Launch:
  """One job to run: the shared warm start, or one run of the grid at one seed."""
  kind: Literal["warm_start", "run"]
  name: str
  seed: int
  workdir: str
  argv: tuple[str, ...]
  steps: int
  responses: int
  run: studies.RunDef | None = None
  study: str = ""
  eval_every: int = 0
  eval_size: int = 0

  @property
  def command(self) -> str:
    return " ".join(shlex.quote(a) for a in self.argv)


Executor = Callable[[Launch, str], int]   # (launch, log path) -> exit status


# Stopping, ordered against starting (`run_study`). A signal's Python handler runs on the main thread
# while the runs start on worker threads, so "is the study stopping?" and "start this run" are both
# decided under `_CHILDREN_LOCK`: the handler first records the signal there (`_stop`), then forwards
# it to the runs in progress; a worker checks that record under the same lock before it starts a run
# (`_unless_stopped`) and again when it registers the run's process (`subprocess_executor`). So a run
# either never starts or is in `_CHILDREN` when the signal is forwarded, or sees the record as it
# registers and is signalled itself.
_CHILDREN: set = set()
_CHILDREN_LOCK = threading.Lock()
_STOPPING: list = []  # the signal, once the runner got one


def stopping() -> int | None:
  """The signal the study is stopping on, or None (read under the lock that orders it with starts)."""
  with _CHILDREN_LOCK:
    return _STOPPING[0] if _STOPPING else None


def subprocess_executor(launch: Launch, log_path: str) -> int:
  """Runs the launch's command from the repository root, stdout and stderr to `log_path`.

  A run the study is stopping for is not started (exit PREEMPTED_EXIT_CODE, as a run stopped at
  step 0). A run started in the instant before the handler ran gets the signal as it registers;
  killed by it before its own handler was installed, it exits -signum, which is read as preempted
  too: it resumes from its last checkpoint like any other."""
  with open(log_path, "a") as log:
    with _CHILDREN_LOCK:
      if _STOPPING:
        return preempt.PREEMPTED_EXIT_CODE
      proc = subprocess.Popen(list(launch.argv), cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                              env=dict(os.environ, PYTHONUNBUFFERED="1"))
      _CHILDREN.add(proc)
    try:
      rc = proc.wait()
    finally:
      with _CHILDREN_LOCK:
        _CHILDREN.discard(proc)
        signum = _STOPPING[0] if _STOPPING else None
    return preempt.PREEMPTED_EXIT_CODE if signum is not None and rc == -signum else rc


def _forward(signum: int) -> None:
  """Sends `signum` to every run in progress; called by `_stop` with `_CHILDREN_LOCK` held."""
  for proc in _CHILDREN:
    if proc.poll() is None:
      proc.send_signal(signum)


def _stop(signum: int) -> None:
  """The guard's first-signal callback: record that the study stops, then forward, in one critical
  section, so that no run starts between the two."""
  with _CHILDREN_LOCK:
    if not _STOPPING:
      _STOPPING.append(signum)
    _forward(signum)


def _flag_value(v: Any) -> str:
  return repr(v) if isinstance(v, float) else str(v)


@dataclasses.dataclass
class Plan:
  study: studies.Study
  root: str
  warm_start: Launch
  launches: list[Launch]
  # The protocol digest every run is stamped with ("" for an exploratory study), and how this plan
  # departs from the protocol's seeds / steps (--seeds / --steps), which its verdict must name.
  protocol: str = ""
  deviations: tuple[str, ...] = ()


def code_version(repo: str = REPO_ROOT) -> str:
  """The commit the runs execute: `git rev-parse HEAD` of `repo`, '+dirty' when rl_jax/ or configs/
  have uncommitted changes, 'unknown' outside a git checkout (an installed package)."""
  try:
    head = subprocess.run(["git", "-C", repo, "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True, timeout=30).stdout.strip()
    dirty = subprocess.run(["git", "-C", repo, "status", "--porcelain", "--untracked-files=no", "--",
                            "rl_jax", "configs"], capture_output=True, text=True, check=True,
                           timeout=30).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return "unknown"
  return head + ("+dirty" if dirty else "")


def plan(study: studies.Study, root: str, seeds: int | None = None, steps: int | None = None,
         wandb_mode: str = "disabled", python: str = sys.executable, launcher: Sequence[str] = ()) -> Plan:
  """Every launch of `study` under `root`; `seeds` / `steps` override the study's.

  `launcher`: a command that runs `python -m rl_jax.main ARGS` given ARGS, e.g.
  `("launch/local_multiprocess.sh", "2")` for every run (and the warm start) on 2 processes.
  """
  entry = tuple(launcher) if launcher else (python, "-m", "rl_jax.main")
  base = load_base(study.base)
  root = os.path.abspath(root)
  ws_dir = os.path.join(root, "warm_start")
  warm = Launch(kind="warm_start", name="warm_start", seed=int(base.get("seed", 0)), workdir=ws_dir,
                argv=(*entry, f"--config={CONFIG_FILE}:warm_start/{study.name}",
                      f"--workdir={ws_dir}"), steps=int(base.sft.steps), responses=0, study=study.name)
  deviations = []
  if study.protocol is not None:
    if seeds is not None and seeds != study.seeds:
      deviations.append(f"--seeds {seeds} instead of the protocol's {study.seeds}")
    if steps is not None and steps != study.steps:
      deviations.append(f"--steps {steps} instead of the protocol's {study.steps}")
  launches = []
  for run in study.runs():
    overrides = dict(run.overrides)
    if steps is not None:
      overrides["rl.steps"] = steps
    cfg = sweeps.apply_overrides(base, overrides)
    n_steps, responses = int(cfg.rl.steps), int(cfg.rl.prompts_per_step * cfg.rl.group_size)
    for seed in range(study.seeds if seeds is None else seeds):
      workdir = os.path.join(root, run.panel, run.line, f"seed{seed}")
      argv = list(entry)
      if sweeps.flag_expressible(overrides, base):
        argv += [f"--config={config_file(study.base)}", f"--workdir={workdir}"]
        argv += [f"--config.{k}={_flag_value(v)}" for k, v in overrides.items()]
      else:
        argv += [f"--config={CONFIG_FILE}:{study.name}/{run.name}", f"--workdir={workdir}"]
        if steps is not None:
          argv.append(f"--config.rl.steps={steps}")
      argv += [f"--config.seed={seed}", "--config.warm_start.source=sft",
               f"--config.warm_start.path={ws_dir}", f"--config.logging.wandb_mode={wandb_mode}"]
      launches.append(Launch(kind="run", name=run.name, seed=seed, workdir=workdir, argv=tuple(argv),
                             steps=n_steps, responses=responses, run=run, study=study.name,
                             eval_every=int(cfg.rl.eval_every), eval_size=int(cfg.rl.eval_size)))
  digest = (study.protocol.digest(protocol_lib.study_definition(study)) if study.protocol is not None else "")
  return Plan(study=study, root=root, warm_start=warm, launches=launches, protocol=digest,
              deviations=tuple(deviations))


_read_json = artifacts.read_json


def status(launch: Launch) -> str:
  """'done', 'collapsed' (aborted on a non-finite value), 'resume@<step>', or 'new'."""
  if launch.kind == "warm_start":
    return "done" if os.path.exists(os.path.join(launch.workdir, WARM_START_DONE)) else "new"
  summary = _read_json(os.path.join(launch.workdir, artifacts.SUMMARY))
  if summary is not None and summary.get("steps") == launch.steps:
    return "done"
  failed = _read_json(os.path.join(launch.workdir, runs_lib.FAILED_FILE))
  if artifacts.aborted_non_finite(failed):
    return "collapsed"
  rows = runs_lib.read_rows(launch.workdir)
  last = max((r["step"] for r in rows), default=None)
  return f"resume@{last}" if last else "new"


def _remaining_steps(launch: Launch, st: str) -> int:
  return launch.steps - int(st.split("@")[1]) if st.startswith("resume@") else launch.steps


def step_cost(root: str) -> tuple[float, float, str]:
  """(seconds per response-step, seconds of overhead per run, source) measured from the wall time
  of finished, unresumed runs of >= MEASURE_MIN_STEPS steps in `root`, else the module's constants."""
  per, n = 0.0, 0
  for d in runs_lib.find_workdirs([os.path.join(root, "**")]):
    info = _read_json(os.path.join(d, runs_lib.STUDY_FILE)) or {}
    if (info.get("wall_s") and info.get("steps", 0) >= MEASURE_MIN_STEPS and info.get("responses")
        and not info.get("resumed")):
      per += max(info["wall_s"] - RUN_OVERHEAD_S, 0.0) / (info["steps"] * info["responses"])
      n += 1
  if n:
    return per / n, RUN_OVERHEAD_S, f"measured over {n} finished runs in {root}"
  return STEP_S_PER_RESPONSE, RUN_OVERHEAD_S, "constant STEP_S_PER_RESPONSE (no finished run measured yet)"


def estimate_s(p: Plan) -> tuple[float, str]:
  """Estimated CPU seconds of what is left to run (this machine's measured rate when available)."""
  per, overhead, source = step_cost(p.root)
  total = WARM_START_S if status(p.warm_start) != "done" else 0.0
  for launch in p.launches:
    st = status(launch)
    if st not in ("done", "collapsed"):
      total += overhead + _remaining_steps(launch, st) * launch.responses * per
  return total, source


def dry_run(p: Plan, out=None) -> float:
  out = out or sys.stdout
  total, source = estimate_s(p)
  print(f"study {p.study.name}: {len(p.launches)} runs ({len(p.study.runs())} configs x "
        f"{len(p.launches) // max(len(p.study.runs()), 1)} seeds) under {p.root}", file=out)
  print(f"  {'warm_start':40s} {status(p.warm_start):12s} {p.warm_start.command}", file=out)
  for launch in p.launches:
    print(f"  {launch.name + f'/seed{launch.seed}':40s} {status(launch):12s} {launch.steps:5d} steps "
          f"x {launch.responses} responses", file=out)
  print(f"estimated CPU time left: {total / 60:.1f} min ({total / 3600:.2f} h; {source}); "
        f"divide by --jobs for wall time on enough cores", file=out)
  if p.study.protocol is not None:
    print(protocol_text(p), file=out)
  return total


def protocol_text(p: Plan) -> str:
  """The pre-registered protocol of a plan: metric, contrasts with their power, rule, deviations."""
  proto = p.study.protocol
  n = len({launch.seed for launch in p.launches})
  lines = [f"protocol {p.protocol}: primary metric = {proto.describe_metric()} (eval set >= {proto.min_eval_size}); "
           f"{n} paired seeds; paired t + exact Wilcoxon signed-rank, Holm over {len(proto.contrasts)} contrast(s), "
           f"alpha {proto.alpha:g}; extra seeds: {proto.extra_seeds}"]
  if proto.collapse_floor is not None:
    lines.append(f"  second primary endpoint: the {proto.describe_collapse()}; exact McNemar, Holm over the "
                 "contrasts")
  power, mde = verdicts_lib.power_of(proto, n)
  for c in proto.contrasts:
    q = f" ({c.question})" if c.question else ""
    lines.append(f"  contrast {c.name}{q}")
  if proto.planning is not None:
    lines.append(f"  power at n = {n}: {power:.2f} for a difference of {proto.planning.delta:.3f}; 80% power "
                 f"for |difference| >= {mde:.3f} (paired s.d. {proto.planning.sd_diff:.3f}: "
                 f"{proto.planning.source})")
  elif proto.contrasts:
    lines.append("  power: not stated (no planning s.d. declared)")
  if proto.rule:
    lines.append(f"  selection rule: {proto.rule} (rl_jax/study/rules.py)")
  for d in p.deviations:
    lines.append(f"  DEVIATION: {d}")
  return "\n".join(lines)


def print_commands(p: Plan, out=None) -> None:
  """One shell command per launch, the warm start first (it must finish before the runs start)."""
  out = out or sys.stdout
  print(f"# study {p.study.name}, from the repository root: run the first command to completion, "
        "then the rest in any order", file=out)
  for launch in [p.warm_start] + p.launches:
    argv = launch.argv
    shown = ("python",) + argv[1:] if argv[1:3] == ("-m", "rl_jax.main") else argv  # else a --launcher's
    print(" ".join(shlex.quote(a) for a in shown), file=out)


def _tail(path: str, n: int = 20) -> str:
  if not os.path.exists(path):
    return ""
  with open(path, errors="replace") as f:
    return "".join(f.readlines()[-n:])


def execute(launch: Launch, executor: Executor, commit: str = "unknown", protocol: str = "") -> int:
  """Runs one launch, records its labels, commit, protocol digest and wall time (study.json) or its
  failure (failed.json)."""
  os.makedirs(launch.workdir, exist_ok=True)
  log = os.path.join(launch.workdir, "run.log" if launch.kind == "run" else "study_warm_start.log")
  info_path = os.path.join(launch.workdir, runs_lib.STUDY_FILE)
  st = status(launch)
  info = None
  if launch.run is not None:
    info = {"study": launch.study, "run": launch.name, "panel": launch.run.panel, "line": launch.run.line,
            "seed": launch.seed, "steps": launch.steps, "responses": launch.responses,
            "overrides": launch.run.overrides, "command": launch.command, "resumed": st != "new",
            "commit": commit, "protocol": protocol}
    old = _read_json(info_path) or {}
    if st != "new" and old.get("commit") not in (None, commit):
      # A run resumed at another commit is a mixture: keep both, the analysis refuses to pool it.
      info["commit"] = f"{old['commit']}|{commit}"
    with open(info_path, "w") as f:
      json.dump(info, f, indent=1, default=str)
  t0 = time.time()
  rc = executor(launch, log)
  failed_path = os.path.join(launch.workdir, runs_lib.FAILED_FILE)
  if rc == preempt.PREEMPTED_EXIT_CODE:  # checkpointed on a signal: resumable, not a failure
    return rc
  if rc != 0:
    with open(failed_path, "w") as f:
      json.dump({"rc": rc, "reason": artifacts.failure_reason(rc), "error": _tail(log)}, f, indent=1)
    return rc
  if os.path.exists(failed_path):
    os.remove(failed_path)
  if launch.kind == "warm_start":
    with open(os.path.join(launch.workdir, WARM_START_DONE), "w") as f:
      json.dump({"wall_s": time.time() - t0, "command": launch.command}, f)
  elif info is not None:
    info["wall_s"] = time.time() - t0
    with open(info_path, "w") as f:
      json.dump(info, f, indent=1, default=str)
  return rc


def run_study(p: Plan, executor: Executor = subprocess_executor, jobs: int = 1,
              progress: bool = True) -> dict[str, int]:
  """Warm start (once), then every unfinished launch, `jobs` at a time; returns counts by outcome."""
  if jobs < 1:
    raise ValueError(f"--jobs must be >= 1, got {jobs}")
  counts = {"skipped": 0, "ok": 0, "failed": 0, "preempted": 0}
  commit = code_version()
  # SIGTERM / SIGINT: forwarded to the runs in progress, the warm start included (each checkpoints
  # its step and exits 75); no new run starts; `preempt.Preempted` then tells the caller (the CLI
  # exits 75 too).
  with _CHILDREN_LOCK:
    _STOPPING.clear()
  guard = preempt.Guard(on_signal=_stop)
  bar = None
  try:
    # The main thread waits where a signal wakes it whichever thread the kernel gave it to
    # (preempt.MainThreadWaiter), with the signal unblocked on it (preempt.signals_to_main_thread);
    # every launch, the warm start too, runs on the pool.
    with (guard, preempt.signals_to_main_thread(), preempt.MainThreadWaiter() as waiter,
          concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool):
      if status(p.warm_start) != "done":
        print(f"[study] warm start -> {p.warm_start.workdir}", flush=True)
        warm = pool.submit(_unless_stopped, p.warm_start, executor)
        waiter.watch([warm])
        waiter.wait({warm})
        rc = warm.result()
        if guard.signum is None and rc != 0:
          raise RuntimeError(f"study warm start failed (exit {rc}); log: {p.warm_start.workdir}/study_warm_start.log")
      # Seed-major: every cell's seed 0 runs before any seed 1, so a grid stopped early has every cell
      # at fewer seeds rather than some cells at all seeds and others at none.
      todo = sorted((launch for launch in p.launches if status(launch) not in ("done", "collapsed")),
                    key=lambda launch: launch.seed)
      counts["skipped"] = len(p.launches) - len(todo)
      bar = tqdm.tqdm(total=len(p.launches), initial=counts["skipped"], desc=f"study {p.study.name}",
                      unit="run", disable=not progress)
      futures = {pool.submit(_unless_stopped, launch, executor, commit, p.protocol): launch
                 for launch in todo}
      waiter.watch(futures)
      pending = set(futures)
      while pending:
        for fut in waiter.wait(pending):
          pending.discard(fut)
          launch = futures[fut]
          rc = fut.result()
          if rc is None:
            continue  # not started: the study was stopped first
          outcome = "ok" if rc == 0 else "preempted" if rc == preempt.PREEMPTED_EXIT_CODE else "failed"
          counts[outcome] += 1
          if outcome == "failed":
            tqdm.tqdm.write(f"[study] {launch.name}/seed{launch.seed} exited {rc}; see {launch.workdir}/run.log")
          bar.update(1)
  finally:
    if bar is not None:
      bar.close()
  if guard.signum is not None:
    raise preempt.Preempted(None, guard.signum, p.root)
  return counts


def _unless_stopped(launch: Launch, *args) -> int | None:
  """Runs `launch` unless the study is stopping (None: not started). The check reads the record
  `_stop` writes first, not the guard's flag: the check and the record share one lock."""
  if stopping() is not None:
    return None
  return execute(launch, *args)


FINISHED = ("done", "collapsed")


def unfinished(p: Plan) -> list[Launch]:
  """The grid's launches that have not finished (new, or stopped part-way)."""
  return [launch for launch in p.launches if status(launch) not in FINISHED]


def groups_of(p: Plan) -> list[runs_lib.Group]:
  """The study's finished runs, one group per grid cell, labelled by the study.

  A run still going (or stopped part-way) is left out: its last evaluation is not the final one,
  and a mean over seeds must compare runs at the same step.
  """
  groups = []
  for run in p.study.runs():
    rs = [runs_lib.load_run(launch.workdir, name=run.name) for launch in p.launches
          if launch.run is not None and launch.run.name == run.name and status(launch) in FINISHED]
    rs = [r for r in rs if r.rows]
    if rs:
      groups.append(runs_lib.Group(name=run.name, panel=run.panel, line=run.line, runs=rs))
  return groups


def verdict_skeleton(p: Plan, summaries: Sequence[aggregate.GroupSummary], command: str,
                     groups: Sequence[runs_lib.Group] = (), result: verdicts_lib.Analysis | None = None) -> str:
  """verdict.md: the command, the numbers and per-panel orderings, and the verdict: mechanical from
  the protocol's analysis when the study has one, else a placeholder for a person."""
  wall = [(_read_json(os.path.join(launch.workdir, runs_lib.STUDY_FILE)) or {}).get("wall_s")
          for launch in p.launches]
  wall_s = sum(w for w in wall if w)
  lines = [f"# Study `{p.study.name}`", "", p.study.description, "",
           f"Command: `{command}`", "",
           f"Runs: {len(p.launches)} ({len(summaries)} configurations with results); summed run wall "
           f"time {wall_s / 60:.1f} min; base config `{p.study.base}`.", ""]
  if p.deviations:
    lines += ["**Deviations from the protocol:** " + "; ".join(p.deviations) + ".", ""]
  left = unfinished(p)
  if left:
    lines += [f"**Unfinished: {len(left)} of {len(p.launches)} runs** had not finished and are left out of "
              "every number below: " + ", ".join(f"{launch.name}/seed{launch.seed}" for launch in left) + ".", ""]
  lines += [f"Collapse (the one definition, the protocol's declared endpoint): an evaluation after step "
            f"{aggregate.COLLAPSE_AFTER} with held-out greedy accuracy <= {aggregate.COLLAPSE_FLOOR:g} (or "
            "non-finite), or an abort on a non-finite loss (rl_jax/analysis/aggregate.py).", "", "## Numbers (mean +- s.e. over seeds)", "",
            tables.markdown(summaries), "## Final held-out greedy accuracy, best first, per panel", ""]
  for panel in dict.fromkeys(s.panel for s in summaries):
    row = sorted((s for s in summaries if s.panel == panel),
                 key=lambda s: -s.final_accuracy[0] if s.final_accuracy[2] else float("inf"))
    lines.append(f"- {panel}: " + " > ".join(f"{s.line} {tables.fmt(s.final_accuracy)}" for s in row))
  if groups:
    lines += ["", "## Do the meters warn before a collapse?", "",
              f"Alarm: drift TV at >= {precursors.DRIFT_FACTOR:g}x, first-order cosine at <= "
              f"{precursors.COSINE_FACTOR:g}x its median over steps < {precursors.BASELINE_STEPS} "
              "(rl_jax/analysis/precursors.py); lead = collapse step - alarm step.", "",
              precursors.markdown(groups)]
  proto = result.protocol if result is not None else None
  if groups and proto is not None and proto.collapse_floor is not None:
    runs = [r for g in groups for r in g.runs]
    same = (proto.collapse_floor, proto.collapse_after) == (precursors.FLOOR, precursors.FLOOR_AFTER)
    lines += ["", "## Collapse predictors, matched windows (declared in rl_jax/analysis/precursors.py)", "",
              f"The event: accuracy <= {precursors.FLOOR:g} after step {precursors.FLOOR_AFTER} or an abort "
              + ("(the protocol's collapse endpoint)" if same else
                 f"(NOT the protocol's endpoint, <= {proto.collapse_floor:g} after step {proto.collapse_after})")
              + f"; {sum(precursors.floor_event_step(r) is not None for r in runs)} of {len(runs)} finished runs "
              "reach it. Each (collapsed, other) pair is compared over the steps before the collapsed run's event.",
              "", precursors.matched_markdown(runs, panel_of=lambda r: (r.study or {}).get("panel", ""))]
  if result is not None:
    verdicts = [f"- {r.contrast.name}: {r.verdict}" for r in result.contrasts]
    verdicts += [f"- {r.contrast.name}, collapse: {r.collapse_verdict}" for r in result.contrasts
                 if r.collapse_verdict]
    if result.rule is not None:
      verdicts.append(f"- rule `{result.protocol.rule}`: {result.rule[1]}")
    lines += ["", verdicts_lib.markdown(result), "## Verdict", "",
              "Read mechanically off the pre-registered analysis above:", "", *verdicts, ""]
    return "\n".join(lines)
  lines += ["", "## Verdict", "",
            "Not yet written: state which of the papers' orderings reproduce at this scale and which do "
            "not, citing the numbers above; a null or reversed result is a result.", ""]
  return "\n".join(lines)


def aggregate_study(p: Plan, command: str = "", allow_mixed: bool = False) -> dict[str, str]:
  """Writes ROOT/figure.png, ROOT/table.{md,csv,json} and ROOT/verdict.md (and, for a study with a
  protocol, ROOT/per_seed.{csv,json}, contrasts.json and protocol.json); returns the paths.

  A protocol study refuses (`verdicts.MixedRunsError`) to pool runs of other commits or protocols
  unless `allow_mixed`."""
  groups = groups_of(p)
  if not groups:
    raise FileNotFoundError(f"study {p.study.name}: no run under {p.root} logged metrics yet")
  result = None
  if p.study.protocol is not None:
    scores, unscored = verdicts_lib.score_launches(p.launches, p.study.protocol)
    result = verdicts_lib.analyze(p.study, scores, unscored, allow_mixed=allow_mixed)
  paths, summaries = analysis.compare(groups, p.root, title=f"{p.study.name}: {p.study.description}")
  if result is not None:
    paths.update(verdicts_lib.write(result, p.root))
  paths["verdict"] = os.path.join(p.root, "verdict.md")
  with open(paths["verdict"], "w") as f:
    f.write(verdict_skeleton(p, summaries, command, groups, result))
  return paths
