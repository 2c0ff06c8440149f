"""Notebooks are valid nbformat-4 JSON whose code cells compile (they are not executed here)."""
import glob
import json
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(REPO, "notebooks", "*.ipynb")))


def test_there_are_notebooks():
  assert any(p.endswith("explore_mismatch.ipynb") for p in NOTEBOOKS)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_is_valid_and_compiles(path):
  with open(path) as f:
    nb = json.load(f)
  assert nb["nbformat"] == 4 and isinstance(nb.get("metadata"), dict)
  code = 0
  for i, cell in enumerate(nb["cells"]):
    assert cell["cell_type"] in ("code", "markdown", "raw"), (i, cell["cell_type"])
    src = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
    if cell["cell_type"] != "code":
      continue
    code += 1
    # Stored unexecuted: outputs in the repository would go stale with the code.
    assert cell["outputs"] == [] and cell["execution_count"] is None, f"cell {i} has outputs"
    # IPython magics / shell escapes are not Python: none are used, so none may slip in.
    assert not any(l.lstrip().startswith(("%", "!")) for l in src.splitlines()), f"cell {i}"
    compile(src, f"{os.path.basename(path)}[cell {i}]", "exec")
  assert code > 0
  if "explore_mismatch" in path:
    text = "".join("".join(c["source"]) for c in nb["cells"])
    for call in ("from rl_jax", "sync_weights(", "generate("):
      assert call in text, call


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_rl_jax_names_resolve(path):
  """Every rl_jax module / name a notebook imports, and every `alias.attr` it reads off one, exists.

  The notebooks are not executed here, so a moved function would otherwise go unnoticed.
  """
  import ast  # pylint: disable=g-import-not-at-top
  import importlib  # pylint: disable=g-import-not-at-top
  with open(path) as f:
    nb = json.load(f)
  src = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
  tree = ast.parse(src)
  aliases = {}
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rl_jax"):
      mod = importlib.import_module(node.module)
      for a in node.names:
        obj = getattr(mod, a.name, None)
        if obj is None:  # `from rl_jax.pkg import submodule`
          obj = importlib.import_module(f"{node.module}.{a.name}")
        aliases[a.asname or a.name] = obj
  for node in ast.walk(tree):
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
        and type(aliases.get(node.value.id)).__name__ == "module"):
      assert hasattr(aliases[node.value.id], node.attr), f"{node.value.id}.{node.attr}"
