"""Import structure: no circle (function-local imports included), no arrow from a lower layer of
docs/architecture.md's layer table into a higher one, and every function-local import of an rl_jax
module allowlisted with its reason."""
import ast
import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[1]
ROOT = REPO / "rl_jax"

# Function-local imports of rl_jax modules: (importer, imported) -> why it is not at module level.
# "start-up": keeps an entry point or a light module from loading jax / the heavy stack it needs
# only on one path. "debt": no such reason; the named issue item removes it.
LOCAL_IMPORTS = {
    ("rl_jax.analysis", "rl_jax.analysis.attribution_report"):
        "start-up: `python -m rl_jax.analysis.attribution_report` must find the module unimported by the package",
    ("rl_jax.analysis.runs", "rl_jax.workdir"):
        "start-up: the analysis tools read run files without importing etils (workdir)",
    ("rl_jax.cli", "rl_jax.config_schema"):
        "start-up: the schema imports every job's config modules (jax, flax), only for a bad key's message",
    ("rl_jax.config_schema", "rl_jax.sft"):
        "start-up: an SFT job's schema loads the SFT job's sections only",
    ("rl_jax.config_schema", "rl_jax.rl.job"):
        "start-up: an SFT job's schema does not import the RL stack",
    ("rl_jax.main", "rl_jax.config_schema"):
        "start-up: flags are checked against the schema only when one is unknown",
    ("rl_jax.main", "rl_jax.sft"):
        "start-up: the CLI imports the SFT job only when the job is sft",
    ("rl_jax.main", "rl_jax.rl.trainer"):
        "start-up: the CLI imports the RL trainer only when the job is rl",
    ("rl_jax.models.families", "rl_jax.models.transformer"):
        "start-up: the family registry is read by config checks and the planner without the model code",
    ("rl_jax.plan.cli", "rl_jax.plan.report"):
        "start-up: the planner parses its flags and re-executes itself with the mesh's device count "
        "before the model stack loads (once, in that process)",
    ("rl_jax.rl.trainer", "rl_jax.models.hf_stage"):
        "start-up: only a warm start from a Hugging Face checkpoint needs it",
    ("rl_jax.rl.trainer", "rl_jax.tasks.hf_tokenizer"):
        "start-up: only a Hugging Face warm start loads transformers' tokenizer",
    ("rl_jax.tasks._verifier_worker", "rl_jax.tasks.verifiers"):
        "start-up: the verifier worker caps its memory (RLIMIT_AS) before the verifiers load math-verify",
    ("rl_jax.rl.warm_start", "rl_jax.models.hf"):
        "start-up: only a Hugging Face warm start loads the safetensors reader",
    ("rl_jax.study.config", "rl_jax.rl.warm_start"):
        "start-up: the study runner lists and launches runs without importing the RL stack",
}
# A ratchet: function-local imports of rl_jax modules (statement x module). 56 before issue 40, 47
# before issue 55 item 5 (the planner as a package, the debt entries imported at module level).
MAX_LOCAL_IMPORTS = 17

# Imports from a lower layer into a higher one that are known debt: (importer, imported) -> why.
# Empty since issue 40 item 2 (the kernels layer `ops` under `models`, above `quant`).
UPWARD_DEBT: dict[tuple[str, str], str] = {}


def _modules() -> dict[str, pathlib.Path]:
  mods = {}
  for p in ROOT.rglob("*.py"):
    name = ".".join(p.relative_to(ROOT.parent).with_suffix("").parts)
    mods[name.removesuffix(".__init__")] = p
  return mods


def _targets(node, mods) -> set[str]:
  """The rl_jax modules an import statement imports (a submodule named by `from pkg import sub`)."""
  if isinstance(node, ast.Import):
    return {a.name for a in node.names if a.name in mods}
  if node.module not in mods:
    return set()
  subs = {f"{node.module}.{a.name}" for a in node.names} & mods.keys()
  return subs | ({node.module} if len(subs) < len(node.names) else set())


def _imports() -> tuple[dict[str, set[str]], list[tuple[str, str]]]:
  """(module -> the rl_jax modules it imports at module level, [(importer, imported) per
  function-local import]). An import under `if TYPE_CHECKING:` is neither (it never runs)."""
  mods = _modules()
  top, local = {}, []
  for name, path in mods.items():
    deps = set()

    def visit(node, in_function, name=name, deps=deps):
      for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
          visit(child, True)
        elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
          continue
        elif isinstance(child, (ast.Import, ast.ImportFrom)):
          found = _targets(child, mods) - {name}
          if in_function:
            local.extend((name, t) for t in sorted(found))
          else:
            deps.update(found)
        else:
          visit(child, in_function)

    visit(ast.parse(path.read_text()), False)
    top[name] = deps
  return top, local


def _cycles(graph: dict[str, set[str]]) -> list[str]:
  state, stack, cycles = {}, [], []

  def visit(u):
    state[u] = 1
    stack.append(u)
    for v in sorted(graph.get(u, ())):
      if state.get(v) == 1:
        cycles.append(" -> ".join(stack[stack.index(v):] + [v]))
      elif v not in state:
        visit(v)
    stack.pop()
    state[u] = 2

  for m in sorted(graph):
    if m not in state:
      visit(m)
  return cycles


def _layer_table() -> list[tuple[str, list[str]]]:
  """(layer, module prefixes) rows of docs/architecture.md's '## Import layers' table, lowest first."""
  text = (REPO / "docs" / "architecture.md").read_text()
  section = text.split("## Import layers", 1)[1].split("\n## ", 1)[0]
  rows = []
  for line in section.splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) == 2 and cells[0] not in ("layer", "") and not set(cells[0]) <= set("-"):
      rows.append((cells[0], re.findall(r"`([\w.]+)`", cells[1])))
  return rows


def _layer_of(module: str, table) -> int | None:
  """Index of the layer whose longest prefix names `module` (a prefix matches at a dot boundary)."""
  best = None
  for i, (_, prefixes) in enumerate(table):
    for p in prefixes:
      if (module == p or module.startswith(p + ".")) and (best is None or len(p) > best[1]):
        best = (i, len(p))
  return None if best is None else best[0]


def test_no_import_cycle_function_local_imports_included():
  top, local = _imports()
  assert "rl_jax.rl.loss.loss_config" in top and "rl_jax.rl.loss.methods" in top
  assert not _cycles(top), _cycles(top)
  graph = {m: set(d) for m, d in top.items()}
  for a, b in local:
    graph[a].add(b)
  assert not _cycles(graph), _cycles(graph)


def test_function_local_imports_are_allowlisted_with_a_reason():
  _, local = _imports()
  unlisted = sorted(set(local) - LOCAL_IMPORTS.keys())
  assert not unlisted, (f"function-local imports of rl_jax modules without a reason: {unlisted}; "
                        "import at module level, or add them to LOCAL_IMPORTS with why")
  stale = sorted(LOCAL_IMPORTS.keys() - set(local))
  assert not stale, f"LOCAL_IMPORTS entries no code has any more (delete them): {stale}"
  assert all(why.strip() for why in LOCAL_IMPORTS.values())
  assert len(local) <= MAX_LOCAL_IMPORTS, (
      f"{len(local)} function-local imports of rl_jax modules, more than {MAX_LOCAL_IMPORTS}")


def test_layer_table_covers_every_module():
  table = _layer_table()
  assert [name for name, _ in table][:2] == ["base", "infra"] and len(table) >= 5
  prefixes = [p for _, ps in table for p in ps]
  assert len(prefixes) == len(set(prefixes)), "a prefix is in two layers"
  top, _ = _imports()
  assert not [p for p in prefixes if not any(m == p or m.startswith(p + ".") for m in top)], \
      "a layer names a module that does not exist"
  missing = sorted(m for m in top if _layer_of(m, table) is None)
  assert not missing, f"modules in no layer of docs/architecture.md: {missing}"


def test_no_import_runs_from_a_lower_layer_to_a_higher_one():
  table = _layer_table()
  top, local = _imports()
  edges = {(a, b) for a, deps in top.items() for b in deps} | set(local)
  upward = sorted((a, b) for a, b in edges if _layer_of(a, table) < _layer_of(b, table))
  names = [name for name, _ in table]
  unlisted = [f"{a} ({names[_layer_of(a, table)]}) -> {b} ({names[_layer_of(b, table)]})"
              for a, b in upward if (a, b) not in UPWARD_DEBT]
  assert not unlisted, f"imports from a lower layer into a higher one: {unlisted}"
  stale = sorted(UPWARD_DEBT.keys() - set(upward))
  assert not stale, f"UPWARD_DEBT entries that are no longer upward imports (delete them): {stale}"


def test_the_checks_can_fail():
  """The cycle finder and the layer lookup on hand-made inputs."""
  assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a -> b -> c -> a"]
  assert _cycles({"a": {"b"}, "b": set()}) == []
  table = [("low", ["rl_jax.plan_hw"]), ("high", ["rl_jax.plan", "rl_jax.x.y"])]
  assert _layer_of("rl_jax.plan_hw", table) == 0 and _layer_of("rl_jax.plan", table) == 1
  assert _layer_of("rl_jax.x.y.z", table) == 1 and _layer_of("rl_jax.x", table) is None


def test_no_module_reads_another_modules_private_names():
  """`alias._name` where `alias` is another rl_jax module (bound by an import) is a private call
  across modules: the owner exposes a public function instead (issue 40's `_x.lower` calls)."""
  mods = _modules()
  found = []
  for name, path in mods.items():
    tree = ast.parse(path.read_text())
    aliases = {}
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        aliases.update({(a.asname or a.name): a.name for a in node.names if a.name in mods and a.asname})
      elif isinstance(node, ast.ImportFrom) and node.module in mods:
        aliases.update({(a.asname or a.name): f"{node.module}.{a.name}" for a in node.names
                        if f"{node.module}.{a.name}" in mods})
    for node in ast.walk(tree):
      if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.attr.startswith("_")
          and not node.attr.startswith("__") and aliases.get(node.value.id, name) != name):
        found.append(f"{name}:{node.lineno} {node.value.id}.{node.attr}")
  assert not found, found


def test_the_planners_command_line_loads_without_jax():
  """`python -m rl_jax.plan` parses its flags and re-executes itself with the mesh's device count
  before the model stack loads (rl_jax/plan/__init__.py): its `cli` and `config` import no jax."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  code = ("import sys; from rl_jax.plan import cli, config; "
          "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'flax', 'optax')))")
  out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == "[]", out.stdout
