"""Notebooks are stored without outputs and run top to bottom, in small mode, on a real kernel.

Stored notebooks keep no outputs: outputs of random-init models and timings would churn on
every rerun and bloat diffs, and the findings they support are written as markdown that the
executed run must not contradict (the executed notebook is what the test checks, not a stored
copy). Each notebook has one code cell tagged `parameters`; the test injects a cell after it
setting `SMALL = True` (papermill's convention), so the stored defaults are the full setting.
"""
import ast
import glob
import importlib
import json
import os
import sys
import time

import pytest
from conftest import need

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(REPO, "notebooks", "*.ipynb")))
EXPECTED = ("drift_by_enumeration", "explore_mismatch", "reading_runs", "routing_replay", "sampler_engines")
# Run in the default suite (seconds, no model); the others sample and train the tiny MoE.
FAST = ("drift_by_enumeration",)
KERNEL = "rl_jax_test_python"


def _name(path):
  return os.path.splitext(os.path.basename(path))[0]


def _load(path):
  with open(path) as f:
    return json.load(f)


def _src(cell):
  return cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])


def test_there_are_the_notebooks():
  assert sorted(_name(p) for p in NOTEBOOKS) == sorted(EXPECTED)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_is_valid_stripped_and_compiles(path):
  nb = _load(path)
  assert nb["nbformat"] == 4 and isinstance(nb.get("metadata"), dict)
  code, tagged = 0, 0
  for i, cell in enumerate(nb["cells"]):
    assert cell["cell_type"] in ("code", "markdown", "raw"), (i, cell["cell_type"])
    src = _src(cell)
    if cell["cell_type"] != "code":
      continue
    code += 1
    tagged += "parameters" in cell.get("metadata", {}).get("tags", [])
    assert cell["outputs"] == [] and cell["execution_count"] is None, f"cell {i} has outputs"
    # IPython magics / shell escapes are not Python: none are used, so none may slip in.
    assert not any(l.lstrip().startswith(("%", "!")) for l in src.splitlines()), f"cell {i}"
    # Notebooks import rl_jax (its configs included, as rl_jax.configs) as an installed package.
    assert "sys.path" not in src, f"cell {i} patches sys.path"
    compile(src, f"{os.path.basename(path)}[cell {i}]", "exec")
  assert code > 0 and tagged == 1, f"{path}: needs exactly one code cell tagged 'parameters'"
  text = "\n".join(_src(c) for c in nb["cells"] if c["cell_type"] == "markdown")
  assert "## Findings" in text, f"{path}: no written findings"
  if _name(path) == "explore_mismatch":
    # The sampler is built and run through the library (sync_weights + generate in explore.sample).
    code_text = "\n".join(_src(c) for c in nb["cells"] if c["cell_type"] == "code")
    for call in ("from rl_jax", "explore.sample(", "explore.mismatch_by_regime("):
      assert call in code_text, call


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_rl_jax_names_resolve(path):
  """Every rl_jax module / name a notebook imports, and every `alias.attr` it reads off one, exists
  (a cheap check for the notebooks the default suite does not execute)."""
  src = "\n".join(_src(c) for c in _load(path)["cells"] if c["cell_type"] == "code")
  tree = ast.parse(src)
  aliases = {}
  for node in ast.walk(tree):
    if isinstance(node, (ast.Import, ast.ImportFrom)):  # installed, the configs are rl_jax.configs
      assert "configs" not in {(a.name if isinstance(node, ast.Import) else node.module or "").split(".")[0]
                               for a in node.names}, ast.unparse(node)
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


def _kernel_env(tmp_path, monkeypatch):
  """A kernel spec running this interpreter, and the kernel's environment: the repository's
  rl_jax and configs first on its path (the editable install may point elsewhere), CPU JAX
  with one device (the test session's 8 simulated devices are for sharding tests)."""
  spec_dir = tmp_path / "jupyter" / "kernels" / KERNEL
  spec_dir.mkdir(parents=True)
  (spec_dir / "kernel.json").write_text(json.dumps({
      "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
      "display_name": "rl_jax test", "language": "python"}))
  monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join([REPO] + [p for p in os.environ.get("PYTHONPATH", "").split(
      os.pathsep) if p]))
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  monkeypatch.setenv("XLA_FLAGS", " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                                           if "xla_force_host_platform_device_count" not in f))
  monkeypatch.setenv("WANDB_MODE", "disabled")


def _execute(path, tmp_path, monkeypatch):
  nbformat = need("nbformat")
  nbclient = need("nbclient")
  _kernel_env(tmp_path, monkeypatch)
  nb = nbformat.read(path, as_version=4)
  idx = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
  assert len(idx) == 1, f"{path}: needs one cell tagged 'parameters'"
  nb.cells.insert(idx[0] + 1, nbformat.v4.new_code_cell("SMALL = True  # injected by tests/test_notebooks.py"))
  t0 = time.time()
  # A raising cell raises CellExecutionError here, naming the cell and the traceback.
  nbclient.NotebookClient(nb, timeout=900, kernel_name=KERNEL,
                          resources={"metadata": {"path": os.path.dirname(path)}}).execute()
  print(f"{os.path.basename(path)}: {time.time() - t0:.1f} s in small mode")
  images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if "image/png" in o.get("data", {})]
  assert images, f"{path}: no figure was produced"
  return nb


def _params(path):
  fast = _name(path) in FAST
  return pytest.param(path, id=os.path.basename(path), marks=() if fast else pytest.mark.slow)


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("path", [_params(p) for p in NOTEBOOKS])
def test_notebook_executes(path, tmp_path, monkeypatch):
  nb = _execute(path, tmp_path, monkeypatch)
  errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.get("output_type") == "error"]
  assert not errors, errors


def test_a_notebook_is_executed_in_the_default_suite():
  assert set(FAST) <= {_name(p) for p in NOTEBOOKS}
