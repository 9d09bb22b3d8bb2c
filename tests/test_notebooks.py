"""The notebooks in notebooks/ run top to bottom without an error (executed by nbclient in a Jupyter kernel
on this interpreter, importing this checkout), every figure they show has a title and labelled axes, and
none is committed with outputs."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

REPO_ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO_ROOT / "notebooks").glob("*.ipynb"))
KERNEL_NAME = "diffjax-test-python"
CELL_TIMEOUT_S = 300

# Run first in the kernel: plt.show() refuses a figure with an axes lacking a title (its own or the
# figure's suptitle) or an axis label. Colorbars are exempt.
CHECK_FIGURES = '''
import matplotlib.pyplot as _plt

_original_show = _plt.show


def _show_checked(*args, **kwargs):
    for number in _plt.get_fignums():
        figure = _plt.figure(number)
        suptitle = figure._suptitle.get_text() if figure._suptitle is not None else ""
        for ax in figure.axes:
            if ax.get_label() == "<colorbar>":
                continue
            missing = [what for what, text in [("title", ax.get_title() or suptitle), ("x label", ax.get_xlabel()),
                                               ("y label", ax.get_ylabel())] if not text]
            assert not missing, f"figure {number} has an axes lacking: {', '.join(missing)}"
    return _original_show(*args, **kwargs)


_plt.show = _show_checked
'''


@pytest.fixture(scope="module")
def kernel_env(tmp_path_factory):
    """A kernelspec that runs ipykernel on this interpreter (found through JUPYTER_PATH), and the kernel's
    environment: this checkout on PYTHONPATH, and no simulated-device flag from conftest (a notebook that
    wants devices sets it itself, as it would on a user's machine)."""
    jupyter_dir = tmp_path_factory.mktemp("jupyter")
    spec_dir = jupyter_dir / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True)
    spec = {"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "diffjax tests", "language": "python"}
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    old = os.environ.get("JUPYTER_PATH")
    os.environ["JUPYTER_PATH"] = os.pathsep.join([str(jupyter_dir)] + ([old] if old else []))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", "")).strip()
    env.setdefault("JAX_PLATFORMS", "cpu")
    env.pop("MPLBACKEND", None)  # the kernel's inline backend (Agg rendering, no display)
    yield env
    if old is None:
        os.environ.pop("JUPYTER_PATH", None)
    else:
        os.environ["JUPYTER_PATH"] = old


def execute(notebook, env, workdir: Path):
    """Run every cell (the figure check first) in `workdir`; raises nbclient's CellExecutionError on a cell error."""
    notebook.cells.insert(0, nbformat.v4.new_code_cell(CHECK_FIGURES))
    client = nbclient.NotebookClient(notebook, timeout=CELL_TIMEOUT_S, kernel_name=KERNEL_NAME,
                                     resources={"metadata": {"path": str(workdir)}})
    client.execute(env=env)
    return notebook


def test_there_are_notebooks():
    names = {p.name for p in NOTEBOOKS}
    assert {"01_quickstart.ipynb", "02_port_a_pytorch_checkpoint.ipynb", "03_generate_and_analyse.ipynb",
            "04_sharding.ipynb"} <= names, names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_committed_without_outputs(path):
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name} cell {index} has outputs: clear them"


def missing_imports(notebook) -> list[str]:
    """The top-level packages the notebook's code cells import that this environment lacks (torch in the
    newest-jax CI leg, say): the notebook is skipped for them, as a test file with importorskip would be."""
    names = set()
    for cell in notebook.cells:
        if cell.cell_type != "code":
            continue
        code = "\n".join(line for line in cell.source.splitlines() if not line.lstrip().startswith(("!", "%")))
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return sorted(name for name in names if importlib.util.find_spec(name) is None)


def test_missing_imports_names_what_a_notebook_needs():
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "import numpy as np\nfrom surely_absent_package.sub import x\nimport os, another_absent_one\n!pip list")])
    assert missing_imports(notebook) == ["another_absent_one", "surely_absent_package"]


# Notebooks that train for minutes run on one CI leg: the library calls they make are tested on both.
ONE_LEG = {"03_generate_and_analyse.ipynb"}
# Smaller settings for CI, run right after the notebook's cell tagged "parameters" (papermill's convention, so users
# can do the same): every cell still runs on the real trainer and analyses, only shorter (03: 279 -> ~100 s).
CI_PARAMETERS = {"03_generate_and_analyse.ipynb": "STEPS = 40\nTRAIN_EXAMPLES = 2000\nEVAL_SAMPLES = 4"}


def with_ci_parameters(notebook, name: str):
    """`notebook` with CI_PARAMETERS[name] as a cell after its "parameters" cell (unchanged if it has none)."""
    if name not in CI_PARAMETERS:
        return notebook
    tagged = [i for i, cell in enumerate(notebook.cells) if "parameters" in cell.metadata.get("tags", [])]
    assert len(tagged) == 1, f"{name} needs exactly one cell tagged 'parameters' for CI_PARAMETERS, has {len(tagged)}"
    names = {line.split("=")[0].strip() for line in CI_PARAMETERS[name].splitlines()}
    absent = sorted(n for n in names if f"{n} =" not in notebook.cells[tagged[0]].source)
    assert not absent, f"{name}'s parameters cell does not set {absent}: CI_PARAMETERS would override nothing"
    notebook.cells.insert(tagged[0] + 1, nbformat.v4.new_code_cell(CI_PARAMETERS[name]))
    return notebook


@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.single_leg) if p.name in ONE_LEG else p for p in NOTEBOOKS],
                         ids=[p.stem for p in NOTEBOOKS])
@pytest.mark.slow
def test_notebook_runs(path, kernel_env, tmp_path):
    missing = missing_imports(nbformat.read(path, as_version=4))
    if missing:
        pytest.skip(f"{path.name} imports {', '.join(missing)}, not installed here")
    scratch = tmp_path / "tmp"  # the kernel's temporary directory: what the notebook leaves there
    scratch.mkdir()
    notebook = execute(with_ci_parameters(nbformat.read(path, as_version=4), path.name), {**kernel_env, "TMPDIR": str(scratch)},
                       tmp_path)
    leftovers = [p.name for p in scratch.iterdir() if not p.name.startswith("torchinductor_")]  # torch's own cache
    assert not leftovers, f"{path.name} left temporary files behind: {leftovers}"
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    if path.name.startswith("01"):
        assert sum("image/png" in o.get("data", {}) for o in outputs) >= 3, "the quickstart's figures were not shown"


def test_a_failing_cell_fails_the_run(kernel_env, tmp_path):
    """The runner does fail: a cell that raises, and a figure without axis labels."""
    broken = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1"),
                                             nbformat.v4.new_code_cell("raise RuntimeError('broken cell')")])
    with pytest.raises(nbclient.exceptions.CellExecutionError, match="broken cell"):
        execute(broken, kernel_env, tmp_path)
    unlabelled = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "import matplotlib.pyplot as plt\nplt.plot([1, 2])\nplt.title('t')\nplt.show()")])
    with pytest.raises(nbclient.exceptions.CellExecutionError, match="lacking: x label, y label"):
        execute(unlabelled, kernel_env, tmp_path)
