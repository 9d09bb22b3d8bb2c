"""The documentation site (mkdocs.yml, docs/): its nav and its pages agree, every generated part names a generator
that exists, the generated configuration reference lists every key the config classes have and the kinds tables
every registered kind, and README's links into docs/ resolve. The strict build itself (.ci/docs runs it in CI) is
the slow test at the end, where mkdocs is installed."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from diffjax.config import BLOCK_PARTS
from diffjax.train.config import RunConfig
from diffjax.train.keys import config_keys, kinds_with_options, option_keys

REPO_ROOT = Path(__file__).resolve().parents[1]
DOCS = REPO_ROOT / "docs"


def _hook():
    spec = importlib.util.spec_from_file_location("docs_generated", DOCS / "hooks" / "generated.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def nav_pages(entry=None) -> list[str]:
    if entry is None:
        entry = yaml.safe_load((REPO_ROOT / "mkdocs.yml").read_text())["nav"]
    if isinstance(entry, str):
        return [entry]
    values = entry.values() if isinstance(entry, dict) else entry
    return [page for value in values for page in nav_pages(value)]


def site_pages() -> list[Path]:
    return sorted(path for path in DOCS.rglob("*.md") if "hooks" not in path.relative_to(DOCS).parts)


def test_the_nav_lists_every_page_once_and_only_pages_that_exist():
    nav = nav_pages()
    assert len(nav) == len(set(nav)), f"pages in the nav twice: {sorted(p for p in nav if nav.count(p) > 1)}"
    assert sorted(nav) == sorted(str(path.relative_to(DOCS)) for path in site_pages())


def test_generated_parts_name_known_generators():
    hook = _hook()
    asked = [(page, match.groups()) for page in site_pages() for match in hook.MARKER.finditer(page.read_text())]
    assert {name for _, (name, _) in asked} == set(hook.GENERATORS), asked
    for page, (name, argument) in asked:
        assert name != "kinds" or argument in BLOCK_PARTS, f"{page}: kinds {argument!r}"


KEY_CELL = '<code style="white-space: nowrap">{}</code>'  # a key name the page never breaks mid-word


def test_the_configuration_reference_lists_every_key_under_its_section():
    hook = _hook()
    reference = hook.config_reference(None)
    sections = re.split(r"^##+ ", reference, flags=re.MULTILINE)
    for key in config_keys(RunConfig()):
        section, _, leaf = key.name.rpartition(".")
        body = next(text for text in sections if text.startswith(f"`{section}`\n"))
        assert f"| {KEY_CELL.format(leaf)} |" in body and hook.cell(key.description) in body, key.name
    for part, row in kinds_with_options():
        body = next(text for text in sections if text.startswith(f"`model.{part}: {row.name}`"))
        for key in option_keys(part, row):
            assert f"| {KEY_CELL.format(key.name.rpartition('.')[2])} |" in body, key.name


def test_the_kinds_tables_list_every_registered_kind():
    hook = _hook()
    for part, table in BLOCK_PARTS.items():
        rows = hook.kinds_table(part).split("\n")[2:]
        assert [row.split("|")[1].strip() for row in rows] == [f"`{name}`" for name in table.names()]
    with pytest.raises(ValueError, match="the parts are attention, mlp, residual"):
        hook.kinds_table("norm")


def test_readme_links_into_the_site_resolve():
    links = re.findall(r"\]\((docs/[^)#\s]+)", (REPO_ROOT / "README.md").read_text())
    assert len(links) > 10
    assert not [link for link in links if not (REPO_ROOT / link).is_file()]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="the docs extra is not installed")
def test_the_site_builds_strictly(tmp_path):
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent)) or "mkdocs"
    result = subprocess.run([mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:]
    assert (tmp_path / "site" / "configuration" / "index.html").is_file()


def prose_lines(text: str):
    """(line number, line, the line before) of a page's Markdown outside fenced code blocks."""
    fenced, before = False, ""
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            yield number, line, before
        before = line


def wrap_accidents(text: str) -> list[str]:
    """Lines that Markdown reads as the start of a block where the page meant a wrapped sentence: `>` opens a
    blockquote (the docs use admonitions, never quotes), `#` after a line of text a heading."""
    found = []
    for number, line, before in prose_lines(text):
        if re.match(r" {0,3}>", line):
            found.append(f"line {number} starts with '>' (a blockquote): {line.strip()[:40]!r}")
        elif re.match(r" {0,3}#", line) and before.strip() and not before.lstrip().startswith("<!--"):
            found.append(f"line {number} starts with '#' after text (a heading): {line.strip()[:40]!r}")
    return found


def test_wrap_accidents_are_found():
    text = "a sentence ending at\n  >= 32768 entries\n\n# a heading\ntext then\n# wrapped\n```bash\n# a comment\n```\n"
    assert [line.split(" starts")[0] for line in wrap_accidents(text)] == ["line 2", "line 6"]


@pytest.mark.parametrize("page", [REPO_ROOT / "README.md", *site_pages()], ids=lambda p: p.name)
def test_no_line_of_prose_renders_as_another_block(page):
    assert not wrap_accidents(page.read_text()), f"{page.relative_to(REPO_ROOT)}: {wrap_accidents(page.read_text())}"
