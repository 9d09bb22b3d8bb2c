"""The package's shape, read from the source with ast (nothing is imported): its layers import only downwards (command
lines too), no modules import each other in a circle, no module imports the compatibility shim diffjax.parallel, and no
function outside the Pallas kernel bodies is longer than 80 lines. Each exception is listed here with its reason; the
lists must match the code exactly, so that a new exception fails here and a removed one is struck off."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGE = REPO_ROOT / "diffjax"

# Low to high: a module may import its own layer and those below it. A name covers its submodules; the longest
# name that matches a module decides (diffjax.generate.__main__ is an application, diffjax.generate a library).
LAYERS = (
    # settings and the tables of kinds, no jax
    ("config", ("diffjax.config", "diffjax.config_values", "diffjax.kinds", "diffjax.attention_kinds",
                "diffjax.mlp_kinds", "diffjax.residual_kinds", "diffjax.block_kinds", "diffjax.attention_impls",
                "diffjax.jax_compat", "diffjax.hardware",
                "diffjax.log_lines", "diffjax.mesh_axes", "diffjax.lora_config", "diffjax.lazy_exports",
                "diffjax.command_line")),
    ("sharding", ("diffjax.sharding",)),
    ("ops", ("diffjax.ops",)),
    ("model", ("diffjax.model", "diffjax.losses", "diffjax.lora", "diffjax.generate")),  # and decoding with it
    ("checkpoint", ("diffjax.params_checkpoint", "diffjax.checkpoint", "diffjax.adoption", "diffjax.integrity",
                    "diffjax.run_dir", "diffjax.storage", "diffjax.state_layout")),
    ("convert", ("diffjax.convert",)),
    ("tokenizers", ("diffjax.tokenizers",)),
    ("data", ("diffjax.data",)),  # a DataConfig names its tokenizer
    ("train", ("diffjax.train", "diffjax.parallel")),
    ("applications", ("diffjax.eval", "diffjax.analysis", "diffjax.generate.__main__", "diffjax.console_scripts")),
    ("face", ("diffjax",)),  # the package face (diffjax/__init__.py) hands every layer's names on
)

# Imports that run up a layer, as (importer, imported), lazy ones and a __main__.py's included (a command line belongs
# in the layer of what it runs).
ALLOWED_UPWARD: set[tuple[str, str]] = set()

# Modules that import each other, directly or through others (lazy imports included), as sets.
ALLOWED_CIRCLES: set[frozenset[str]] = set()

# diffjax.parallel only keeps old imports working (its names live in diffjax.sharding and diffjax.train.mesh).
ALLOWED_PARALLEL_IMPORTERS: set[str] = set()

MAX_FUNCTION_LINES = 80
ALLOWED_LONG_FUNCTIONS = {
    # Pallas kernel bodies: one kernel is one program over shared refs, barriers and pipeline state; its steps are
    # split where they stand alone (_copy_query_rows, _in_refs, _Ops), and the rest reads best in order.
    "diffjax/ops/pallas_gpu/forward.py:_forward",
    "diffjax/ops/pallas_gpu/forward.py:_forward.kernel",
    "diffjax/ops/pallas_gpu/dq.py:_dq",
    "diffjax/ops/pallas_gpu/dq.py:_dq.kernel",
    "diffjax/ops/pallas_gpu/dkdv.py:_dkdv",
    "diffjax/ops/pallas_gpu/dkdv.py:_dkdv.kernel",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def layer_of(module: str) -> int:
    matches = [(len(name), rank) for rank, (_, names) in enumerate(LAYERS) for name in names
               if module == name or (module.startswith(name + ".") and name != "diffjax")]
    assert matches, f"{module} is in no layer: add it to LAYERS in {Path(__file__).name}"
    return max(matches)[1]


def _imported(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The diffjax modules an import statement names (its deepest module: `from diffjax import storage` names
    diffjax.storage, `from diffjax.ops import choose` names diffjax.ops)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        assert not node.level, f"{module} line {node.lineno}: a relative import (the package imports absolutely)"
        names = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in MODULES else node.module
                 for alias in node.names]
    found = []
    for name in names:
        while name and name not in MODULES:
            name = name.rpartition(".")[0]
        if name and name != module and name not in found:
            found.append(name)
    return found


@functools.cache
def imports(module: str) -> list[tuple[str, int, bool]]:
    """(imported module, line, lazy) for every diffjax import in `module`; lazy = inside a function."""
    found = []

    def visit(node: ast.AST, lazy: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.extend((name, child.lineno, lazy) for name in _imported(module, child))
            visit(child, lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(MODULES[module].read_text()), False)
    return found


def upward_imports() -> dict[tuple[str, str], list[str]]:
    """{(importer, imported): ["path:line", ...]} for imports into a higher layer."""
    upward: dict[tuple[str, str], list[str]] = {}
    for module, path in MODULES.items():
        for imported, line, _ in imports(module):
            if layer_of(imported) > layer_of(module):
                upward.setdefault((module, imported), []).append(f"{path.relative_to(REPO_ROOT)}:{line}")
    return upward


def test_every_module_has_a_layer():
    for module in MODULES:
        layer_of(module)


def test_layers_import_only_downwards():
    upward = upward_imports()
    order = " -> ".join(name for name, _ in LAYERS)
    new = {pair: where for pair, where in upward.items() if pair not in ALLOWED_UPWARD}
    assert not new, f"imports into a higher layer (layers, low to high: {order}): {new}"
    gone = ALLOWED_UPWARD - set(upward)
    assert not gone, f"no longer imported upwards: strike {sorted(gone)} off ALLOWED_UPWARD"


def circles() -> set[frozenset[str]]:
    """Each set of two or more modules every one of which imports every other, directly or through others."""
    reach = {}
    for module in MODULES:
        seen, todo = set(), [module]
        while todo:
            for imported, _, _ in imports(todo.pop()):
                if imported not in seen:
                    seen.add(imported)
                    todo.append(imported)
        reach[module] = seen
    return {frozenset({module} | {other for other in reach[module] if module in reach[other]})
            for module in MODULES if module in reach[module]}


def test_no_modules_import_each_other():
    found = circles()
    new = [sorted(circle) for circle in found - ALLOWED_CIRCLES]
    assert not new, f"modules that import each other (move what they share into a module both import): {new}"
    gone = [sorted(circle) for circle in ALLOWED_CIRCLES - found]
    assert not gone, f"no longer a circle: strike {gone} off ALLOWED_CIRCLES"


def test_nothing_imports_the_parallel_shim():
    importers = {module for module in MODULES if module != "diffjax.parallel"
                 for imported, _, _ in imports(module) if imported == "diffjax.parallel"}
    assert importers == ALLOWED_PARALLEL_IMPORTERS, (
        "diffjax.parallel is a shim for old imports: import diffjax.sharding or diffjax.train.mesh instead "
        f"(importers {sorted(importers)}, allowed {sorted(ALLOWED_PARALLEL_IMPORTERS)})")


def function_lengths(path: Path) -> dict[str, int]:
    """{"path:Qualified.name": lines from `def` to the body's end} for every function, nested ones included."""
    lengths = {}

    def visit(node: ast.AST, prefix: str):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                if not isinstance(child, ast.ClassDef):
                    lengths[f"{path.relative_to(REPO_ROOT)}:{name}"] = child.end_lineno - child.lineno + 1
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text()), "")
    return lengths


def test_no_function_is_longer_than_80_lines():
    lengths = {}
    for path in sorted([*PACKAGE.rglob("*.py"), *(REPO_ROOT / "benchmarks").rglob("*.py")]):
        lengths |= function_lengths(path)
    long = {name: lines for name, lines in lengths.items() if lines > MAX_FUNCTION_LINES}
    new = {name: lines for name, lines in long.items() if name not in ALLOWED_LONG_FUNCTIONS}
    assert not new, f"functions over {MAX_FUNCTION_LINES} lines: split them into named steps: {new}"
    gone = ALLOWED_LONG_FUNCTIONS - set(long)
    assert not gone, f"no longer over {MAX_FUNCTION_LINES} lines: strike {sorted(gone)} off ALLOWED_LONG_FUNCTIONS"
