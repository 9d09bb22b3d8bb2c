"""The trainer and the decoder stack name no kind: what differs between kinds reaches them through the rows of
diffjax.attention_kinds / mlp_kinds / residual_kinds (their training facets, the layer output channel), so a new kind
trains without edits there. Read from the source with ast: every string literal and identifier (names, attributes,
functions, classes, arguments, keywords, imports) of diffjax/train/ and diffjax/model/transformer.py is searched for
a registered row's name as a word ("_" and any other non-alphanumeric character separate words: `moe_layers` names
"moe"). Docstrings and comments are not searched: they are prose for readers (a usage line such as
`model.attention=standard`) and cannot change what the code does. Each exception is listed with its reason and the
list must match the code exactly."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from diffjax import attention_kinds, mlp_kinds, residual_kinds

REPO_ROOT = Path(__file__).resolve().parents[1]
CHECKED = sorted((REPO_ROOT / "diffjax" / "train").rglob("*.py")) + [REPO_ROOT / "diffjax/model/transformer.py"]
KIND_NAMES = {*attention_kinds.names(), *mlp_kinds.names(), *residual_kinds.names()}

# (file, the word found): why it is not a kind
ALLOWED = {
    ("diffjax/train/config.py", "plain"): "config_values.plain turns config values into plain YAML ones",
    ("diffjax/train/cli.py", "diff"): "--config's help names a shipped config, paper/diff-1.4b",
}


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the docstring nodes of a module, its classes and functions."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                found.add(id(first.value))
    return found


def _words(tree: ast.AST):
    """(line, text) of every string literal (docstrings aside) and identifier."""
    docstrings = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node.lineno, node.value
        elif isinstance(node, ast.Name):
            yield node.lineno, node.id
        elif isinstance(node, ast.Attribute):
            yield node.lineno, node.attr
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.lineno, node.name
        elif isinstance(node, ast.arg):
            yield node.lineno, node.arg
        elif isinstance(node, ast.keyword) and node.arg:
            yield node.value.lineno, node.arg
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            yield from ((node.lineno, text) for alias in node.names for text in (alias.name, alias.asname or ""))
            yield node.lineno, getattr(node, "module", None) or ""


def kind_names_in(source: str) -> list[tuple[int, str]]:
    """(line, kind name) for each kind name used as a word in the source's strings and identifiers."""
    hits = []
    for line, text in _words(ast.parse(source)):
        words = set(re.split(r"[^A-Za-z0-9]+", text))
        # A kind's name with "_" in it (shared_diff) is matched as a run of words.
        hits += [(line, name) for name in KIND_NAMES
                 if (name in words if "_" not in name else re.search(rf"(?<![A-Za-z0-9]){name}(?![A-Za-z0-9])", text))]
    return sorted(set(hits))


def test_the_search_finds_kind_names_in_code_and_not_in_prose():
    source = '''"""A docstring may say moe."""
# so may a comment: mhc
def f(moe_layers, x=None):
    """gdla, here too."""
    if config.mlp == "moe" or x.shared_diff:
        return f"model.attention={name}, diff_v2 or differs"
'''
    assert kind_names_in(source) == [(3, "moe"), (5, "diff"), (5, "moe"), (5, "shared_diff"), (6, "diff"), (6, "diff_v2")]


def test_the_trainer_and_the_stack_name_no_kind():
    found = {}
    for path in CHECKED:
        relative = str(path.relative_to(REPO_ROOT))
        for line, name in kind_names_in(path.read_text()):
            found.setdefault((relative, name), []).append(line)
    unexplained = {key: lines for key, lines in found.items() if key not in ALLOWED}
    assert not unexplained, ("kind names in the trainer / the decoder stack (move what differs into the kind's row: "
                             f"its training facet, diffjax.kinds.Training): {unexplained}")
    assert set(ALLOWED) <= set(found), f"exceptions no longer needed: {sorted(set(ALLOWED) - set(found))}"
