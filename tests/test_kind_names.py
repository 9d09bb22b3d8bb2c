"""The trainer and the stack name no kind and no block: what differs between kinds reaches them through the rows of
diffjax.attention_kinds / mlp_kinds / residual_kinds and diffjax.block_kinds (their training facets: loss terms, step
inputs, the layer output channel; the plan's widths), so a new kind or block trains without edits there. Read from the
source with ast: every string literal and identifier (names, attributes, functions, classes, arguments, keywords,
imports) of diffjax/train/, diffjax/model/transformer.py and the facet contract (diffjax/model/facets.py,
layer_outputs.py) is searched for a registered row's name as a word, in any case ("_" and any other non-alphanumeric
character separate words: `moe_layers` names "moe", `MTP_STACK` names "mtp"), and for the field names of the kinds'
options (`num_experts`, `streams`: reading them is the kind's own business; a field that is also a config's, such as
norm_eps, aside). Docstrings and comments are not searched: they are prose for readers (a usage line such as
`model.attention=standard`) and cannot change what the code does. Each exception is listed with its reason and the
list must match the code exactly."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import dataclasses

from diffjax import attention_kinds, block_kinds, mlp_kinds, residual_kinds
from diffjax.config import ModelConfig
from diffjax.train.config import RunConfig

REPO_ROOT = Path(__file__).resolve().parents[1]
CHECKED = sorted((REPO_ROOT / "diffjax" / "train").rglob("*.py")) + [
    REPO_ROOT / "diffjax/model" / name for name in ("transformer.py", "facets.py", "layer_outputs.py")]
KIND_NAMES = {*attention_kinds.names(), *mlp_kinds.names(), *residual_kinds.names(), *block_kinds.names()}


def _fields(cls) -> set[str]:
    return {field.name for field in dataclasses.fields(cls)}


CONFIG_FIELDS = _fields(ModelConfig).union(*(_fields(type(section)) for section in vars(RunConfig()).values()))
OPTION_FIELDS = {name for table in (attention_kinds, mlp_kinds, residual_kinds) for row in table.TABLE.rows()
                 if row.options for name in _fields(row.options)} - CONFIG_FIELDS

# (file, the word found): why it is not a kind
ALLOWED = {
    ("diffjax/train/config.py", "plain"): "config_values.plain turns config values into plain YAML ones",
    ("diffjax/train/cli.py", "diff"): "--config's help names a shipped config, paper/diff-1.4b",
}


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the docstring nodes of a module, its classes and functions, and of the attribute docstrings of a
    class's fields (the string after a field: config keys' meanings)."""
    def is_string(node):
        return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)

    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            if is_string(node.body[0]):
                found.add(id(node.body[0].value))
        if isinstance(node, ast.ClassDef):
            found |= {id(after.value) for field, after in zip(node.body, node.body[1:])
                      if isinstance(field, ast.AnnAssign) and is_string(after)}
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
    """(line, kind name or option field) for each kind or block name used as a word in the source's strings and
    identifiers (in any case), and each field of a kind's options."""
    hits = []
    for line, text in _words(ast.parse(source)):
        words = set(re.split(r"[^A-Za-z0-9]+", text.lower()))
        # A name with "_" in it (shared_diff, num_experts) is matched as a run of words.
        hits += [(line, name) for name in KIND_NAMES | OPTION_FIELDS
                 if (name in words if "_" not in name else
                     re.search(rf"(?<![A-Za-z0-9]){name}(?![A-Za-z0-9])", text, re.IGNORECASE))]
    return sorted(set(hits))


def test_the_search_finds_kind_names_in_code_and_not_in_prose():
    source = '''"""A docstring may say moe."""
# so may a comment: mhc
def f(moe_layers, x=None):
    """gdla, here too."""
    if config.mlp == "moe" or x.shared_diff:
        return f"model.attention={name}, diff_v2 or differs"
    return MTP_STACK, options.num_experts, "model.mlp_options.score_func", config.norm_eps
'''
    assert kind_names_in(source) == [(3, "moe"), (5, "diff"), (5, "moe"), (5, "shared_diff"), (6, "diff"),
                                     (6, "diff_v2"), (7, "mtp"), (7, "num_experts"), (7, "score_func")]


def test_the_trainer_and_the_stack_name_no_kind_block_or_option():
    found = {}
    for path in CHECKED:
        relative = str(path.relative_to(REPO_ROOT))
        for line, name in kind_names_in(path.read_text()):
            found.setdefault((relative, name), []).append(line)
    unexplained = {key: lines for key, lines in found.items() if key not in ALLOWED}
    assert not unexplained, ("kind names in the trainer / the stack (move what differs into the kind's row: its "
                             f"training facet, diffjax.kinds.Training, or a fact of the row): {unexplained}")
    assert set(ALLOWED) <= set(found), f"exceptions no longer needed: {sorted(set(ALLOWED) - set(found))}"
