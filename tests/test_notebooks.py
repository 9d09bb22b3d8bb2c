"""The notebooks in notebooks/ run top to bottom without an error (executed by nbclient in a Jupyter kernel
on this interpreter, importing this checkout), every figure they show has a title and labelled axes, and
none is committed with outputs. Each opens on Colab as it says: its first cell an Open-in-Colab badge and the runtime
it needs (Colab's `accelerator` / `colab.gpuType` metadata agreeing), its install cell the extras its imports need,
its models within a 16 GB TPU v5e chip by diffjax's memory plan (Colab's free TPU), and its links into the
repository (files and headings) and its words about the mesh current."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

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



# The repository's GitHub URL (mkdocs.yml's repo_url): where Colab opens the notebooks from and their links point.
REPO_URL = yaml.safe_load((REPO_ROOT / "mkdocs.yml").read_text())["repo_url"].rstrip("/")
COLAB_URL = "https://colab.research.google.com/github/" + REPO_URL.removeprefix("https://github.com/")
# Colab's runtime metadata (`accelerator`, `colab.gpuType`) and how the runtime note names it; no accelerator: CPU.
RUNTIMES = {(None, None): "CPU", ("GPU", "T4"): "T4 GPU", ("TPU", "V5E1"): "TPU v5e-1", ("TPU", "V6E1"): "TPU v6e-1"}


def source(cell) -> str:
    return cell.source if isinstance(cell.source, str) else "".join(cell.source)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_the_first_cell_opens_it_on_colab_with_the_runtime_it_needs(path):
    notebook = nbformat.read(path, as_version=4)
    first = notebook.cells[0]
    badge = f"[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]({COLAB_URL}/blob/main/notebooks/{path.name})"
    assert first.cell_type == "markdown" and source(first).startswith(badge), f"{path.name}: the first cell is not {badge}"
    metadata = notebook.metadata
    assert "colab" in metadata, f"{path.name}: no Colab metadata"
    runtime = (metadata.get("accelerator"), metadata["colab"].get("gpuType"))
    assert runtime in RUNTIMES, f"{path.name}: accelerator / gpuType {runtime} is none of {sorted(RUNTIMES.values())}"
    assert f"**Runtime: {RUNTIMES[runtime]}" in source(first), f"{path.name}: the note does not say {RUNTIMES[runtime]}"
    install = next(cell for cell in notebook.cells if cell.cell_type == "code")
    assert f'REPO = "{REPO_URL}"' in source(install) and "pip" in source(install), f"{path.name}: install cell"
    assert re.search(r'`pip install "diffjax(\[[\w,]+\])? @ git\+' + re.escape(REPO_URL) + '"`', source(first)), \
        f"{path.name}: the runtime note does not show the install command"


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading: lower case, punctuation but - and _ dropped, spaces as -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_github_slugs():
    assert github_slug("Does it fit? `diffjax-train --plan`") == "does-it-fit-diffjax-train---plan"
    assert github_slug("The mesh") == "the-mesh"


def broken_links(text: str) -> list[str]:
    """Links to this repository's files on GitHub (and Colab's copies of its notebooks) whose file or heading does
    not exist."""
    broken = []
    for url, path, anchor in re.findall(r"((?:%s|%s)/blob/main/([^)\s#\"'`]+)(?:#([^)\s\"'`]+))?)"
                                        % (re.escape(REPO_URL), re.escape(COLAB_URL)), text):
        target = REPO_ROOT / path
        if not target.exists():
            broken.append(f"{url}: no file {path}")
        elif anchor and anchor not in {github_slug(line.lstrip("#")) for line in target.read_text().splitlines()
                                       if re.match(r"#{1,6} ", line)}:
            broken.append(f"{url}: {path} has no heading #{anchor}")
    return broken


def test_broken_links_are_found():
    assert broken_links(f"[a]({REPO_URL}/blob/main/docs/multi-host.md#the-mesh) [b]({REPO_URL}/blob/main/README.md)") == []
    assert len(broken_links(f"[a]({REPO_URL}/blob/main/docs/multi-host.md#scale-out) "
                            f"[b]({REPO_URL}/blob/main/docs/absent.md) [c]({COLAB_URL}/blob/main/notebooks/x.ipynb)")) == 3


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_links_into_the_repository_resolve(path):
    text = "\n".join(source(cell) for cell in nbformat.read(path, as_version=4).cells)
    assert not broken_links(text), f"{path.name}: {broken_links(text)}"
    assert not re.search(r"\(README, \"", text), f"{path.name}: a section named in words; link it ({REPO_URL}/blob/main/...#heading)"


def test_what_the_notebooks_say_of_the_mesh_is_its_axes():
    from diffjax.mesh_axes import MESH_AXES

    for path in NOTEBOOKS:
        text = "\n".join(source(cell) for cell in nbformat.read(path, as_version=4).cells if cell.cell_type == "markdown")
        for grid in re.findall(r"(\d+)-D grid", text):
            assert int(grid) == len(MESH_AXES), f"{path.name}: a {grid}-D grid, the mesh has {len(MESH_AXES)} axes"
        for axes in re.findall(r"`\((data, [a-z, ]+)\)` device mesh", text):
            assert tuple(axes.split(", ")) == MESH_AXES, f"{path.name}: ({axes}), the mesh is {MESH_AXES}"


# Run in a fresh interpreter per notebook: its code cells up to the one tagged "config" (the one that makes its
# models' configs from its settings), then the imports of the cells after it; prints the top-level modules loaded
# and the memory plan on one TPU v5e chip of every config the cells made (diffjax ModelConfig / RunConfig, a
# transformers config through diffjax's reader). A model alone is planned as training 8 sequences of its
# max_seq_len: more than any notebook runs.
PROBE = r"""
import ast, contextlib, dataclasses, io, json, sys

notebook = json.load(open(sys.argv[1]))
cells = ["".join(c["source"]) for c in notebook["cells"] if c["cell_type"] == "code"]
tags = [c["metadata"].get("tags", []) for c in notebook["cells"] if c["cell_type"] == "code"]
tagged = [i for i, t in enumerate(tags) if "config" in t]
if len(tagged) != 1:
    sys.exit(f"{len(tagged)} code cells tagged 'config': tag the one cell that makes the models' configs")
namespace = {"__name__": "__main__"}
with contextlib.redirect_stdout(io.StringIO()):
    for cell in cells[:tagged[0] + 1]:
        exec(compile(cell, "cell", "exec"), namespace)
    for cell in cells[tagged[0] + 1:]:
        for node in ast.parse(cell).body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                exec(compile(ast.Module([node], []), "imports", "exec"), {})
modules = sorted({name.split(".")[0] for name in sys.modules})

from diffjax.config import ModelConfig
from diffjax.convert import config_from_hf
from diffjax.train.config import RunConfig
from diffjax.train.plan import plan_memory


def as_run(value):
    if isinstance(value, RunConfig):
        return value
    if not isinstance(value, ModelConfig):
        value = config_from_hf(value.to_dict())
    run = RunConfig()
    return dataclasses.replace(run, model=value, data=dataclasses.replace(run.data, seq_len=value.max_seq_len),
                               train=dataclasses.replace(run.train, batch_size=8, batch_tokens=None,
                                                         micro_batch_per_device=None))


def is_config(value):
    return isinstance(value, (ModelConfig, RunConfig)) or (hasattr(value, "model_type") and hasattr(value, "to_dict"))


found = {}
for name, value in namespace.items():
    values = value.items() if isinstance(value, dict) else [(name, value)]
    found.update({f"{name}[{key!r}]" if isinstance(value, dict) else name: item for key, item in values
                  if is_config(item)})
plans = []
for name, value in found.items():
    plan = plan_memory(as_run(value), "v5e", 1)
    plans.append({"name": name, "fits": plan.fits, "total_gib": plan.total / 2**30,
                  "largest": plan.largest_micro_batch, "micro_batch": plan.micro_batch})
print(json.dumps({"modules": modules, "plans": plans}))
"""
# Modules whose import means the notebook needs an extra that Colab lacks (the install cell's `extras`).
EXTRA_OF_MODULE = {"grain": "train", "torch": "torch", "transformers": "torch"}


@pytest.fixture(scope="module")
def probes(tmp_path_factory, kernel_env):
    """PROBE's answer per notebook, all run at once (None: the notebook imports what is not installed here;
    {"error": ...}: the probe failed)."""
    running = {}
    for path in NOTEBOOKS:
        if missing_imports(nbformat.read(path, as_version=4)):
            running[path.name] = None
            continue
        tmp = tmp_path_factory.mktemp(path.stem)
        running[path.name] = subprocess.Popen([sys.executable, "-c", PROBE, str(path)], cwd=tmp,
                                              env={**kernel_env, "TMPDIR": str(tmp)}, stdout=subprocess.PIPE,
                                              stderr=subprocess.PIPE, text=True)
    answers = {}
    for name, process in running.items():
        if process is None:
            answers[name] = None
            continue
        out, err = process.communicate(timeout=300)
        answers[name] = json.loads(out.strip().splitlines()[-1]) if process.returncode == 0 else {"error": err[-3000:]}
    return answers


def probe_of(probes, path: Path) -> dict:
    if probes[path.name] is None:
        pytest.skip(f"{path.name} imports what is not installed here")
    assert "error" not in probes[path.name], f"{path.name}: the probe failed:\n{probes[path.name]['error']}"
    return probes[path.name]


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_the_notebooks_models_fit_one_tpu_v5e_chip(path, probes):
    """Colab's free TPU runtime is one v5e chip of 16 GB: every model a notebook makes trains there by the plan."""
    plans = probe_of(probes, path)["plans"]
    assert plans, f"{path.name}: its 'config' cell made no ModelConfig, RunConfig or transformers config"
    too_big = [p for p in plans if not p["fits"] or p["largest"] < p["micro_batch"]]
    assert not too_big, f"{path.name}: not within a 16 GB v5e chip by the plan: {too_big}"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_the_install_cell_installs_the_extras_the_imports_need(path, probes):
    needed = {EXTRA_OF_MODULE[m] for m in probe_of(probes, path)["modules"] if m in EXTRA_OF_MODULE}
    install = source(next(cell for cell in nbformat.read(path, as_version=4).cells if cell.cell_type == "code"))
    listed = re.search(r"^    extras = \[(.*?)\]", install, re.MULTILINE)
    assert listed, f"{path.name}: the install cell has no `extras = [...]` line"
    installed = set(re.findall(r'"(\w+)"', listed.group(1)))
    assert needed <= installed, f"{path.name} imports need the extras {sorted(needed)}; it installs {sorted(installed)}"
