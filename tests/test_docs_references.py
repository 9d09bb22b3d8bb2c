"""Every dotted diffjax name that README.md, the documentation site's pages (docs/) and the notebooks mention
(`diffjax.checkpoint.load_model`, ...) exists: a renamed or moved function cannot leave the docs pointing at nothing."""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").rglob("*.md")),
        *sorted((REPO_ROOT / "notebooks").glob("*.ipynb"))]


def _text(path: Path) -> str:
    if path.suffix == ".ipynb":
        return "\n".join("".join(cell["source"]) for cell in json.loads(path.read_text())["cells"])
    return path.read_text()


def resolves(dotted: str) -> bool:
    """Whether `dotted` names a module or an attribute reachable from its longest importable module prefix."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for name in parts[split:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


def test_resolves_tells_a_missing_name():
    assert resolves("diffjax.ops.diff_attention") and resolves("diffjax.train")
    assert not resolves("diffjax.train.state_checkpoints.no_such_function") and not resolves("diffjax.no_such_module")


@pytest.mark.parametrize("path", DOCS, ids=[str(p.relative_to(REPO_ROOT)) for p in DOCS])
def test_every_diffjax_name_in_the_docs_exists(path):
    names = sorted(set(re.findall(r"\bdiffjax(?:\.[A-Za-z_]\w*)+", _text(path))))
    site_page = path.suffix == ".md" and path != DOCS[0]  # (a page of the site may name none)
    assert names or site_page, f"{path.name} mentions no diffjax name: the pattern is broken"
    missing = [name for name in names if not resolves(name)]
    assert not missing, f"{path.name} names what does not exist: {missing}"
