"""The package has no import cycle: module-level imports of rl_jax modules form a DAG."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "rl_jax"


def _graph() -> dict[str, set[str]]:
  """Module -> the rl_jax modules its top-level statements import (a `TYPE_CHECKING` or other
  guarded import, and an import inside a function, are not import-time edges)."""
  mods = {}
  for p in ROOT.rglob("*.py"):
    name = ".".join(p.relative_to(ROOT.parent).with_suffix("").parts)
    mods[name.removesuffix(".__init__")] = p
  graph = {}
  for name, path in mods.items():
    deps = set()
    for node in ast.parse(path.read_text()).body:
      if isinstance(node, ast.Import):
        deps.update(a.name for a in node.names if a.name in mods)
      elif isinstance(node, ast.ImportFrom) and node.module in mods:
        subs = {f"{node.module}.{a.name}" for a in node.names} & mods.keys()
        deps.update(subs)
        if len(subs) < len(node.names):   # a name from the module itself, not a submodule of it
          deps.add(node.module)
    graph[name] = deps - {name}
  return graph


def test_no_import_cycle():
  graph = _graph()
  assert "rl_jax.rl.loss_config" in graph and "rl_jax.rl.methods" in graph
  state, stack, cycles = {}, [], []

  def visit(u):
    state[u] = 1
    stack.append(u)
    for v in sorted(graph[u]):
      if state.get(v) == 1:
        cycles.append(" -> ".join(stack[stack.index(v):] + [v]))
      elif v not in state:
        visit(v)
    stack.pop()
    state[u] = 2

  for m in sorted(graph):
    if m not in state:
      visit(m)
  assert not cycles, cycles
