"""README.md's and the documentation site's recipes work as printed: every ```bash / ```python block in README and
in the pages of mkdocs.yml's nav (docs/) is either a recipe (`<!-- recipe: NAME -->` on a line above it, optionally
`; needs: module, ...`) or says why it is not run here (`<!-- not run by tests/test_readme_recipes.py: REASON -->`:
CI's own command, a cluster, a download). The recipes run in order (README's, then the site's pages in nav order),
one after another as a user would type them. Each page runs in a fresh directory of its own holding train.py, the
package (diffjax/, on PYTHONPATH) and its shipped configs (configs/: the ones the recipes train, shortened there), what
the docs ask users to bring (a Hugging Face directory at path/to/DiffLlama, ..., made once by `user_files`) and the
run directories earlier pages trained (runs/, shared: a page names the runs it uses, "the quickstart's run"); nothing
else a page leaves behind (out/, a file it wrote) reaches the next one, so a recipe that needs it fails where it is
printed. Only sizes change, through SIZES below. A recipe fails on a non-zero exit or a line saying it did nothing
useful (FAILURE_MARKERS). `RECIPE_PAGES=docs/analyses.md,...` runs README's recipes (they train the runs the pages
use) and those pages' only."""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
README = REPO_ROOT / "README.md"
MKDOCS = REPO_ROOT / "mkdocs.yml"
NOT_RUN = "not run by tests/test_readme_recipes.py:"

# (recipe, or a file copied from the repository; as printed; as run here): sizes only, so CI runs the same commands
# with fewer steps and tokens. Every printed text must occur where it is named (checked), so the table cannot rot.
SIZES = [
    ("configs/tiny.yaml", "steps: 400", "steps: 12"),  # the quickstart and every run on tiny.yaml
    ("quickstart", 'pip install -e ".[train]" && ', ""),  # the test's environment is installed already
    ("hooks", "train.steps=200", "train.steps=12"),
    ("lora", "train.steps=1000", "train.steps=6"),
    ("convert-export-train-upcycle", "train.steps=200", "train.steps=6"),
    ("convert-export-train-upcycle", "train.steps=1000", "train.steps=6"),
    ("generate", "--max-new-tokens 200", "--max-new-tokens 16"),
    ("analyse", "--tokens 65536", "--tokens 4096"),
    ("analyse", "--count 10000", "--count 100"),
]
# A recipe that prints one of these did not do what it says, whatever its exit status.
FAILURE_MARKERS = re.compile(r"^FAIL\b|nothing to do", re.MULTILINE)
COPIED = ("train.py", "diffjax", "configs")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)


@dataclass(frozen=True)
class Block:
    line: int  # README line of the opening fence
    language: str
    code: str
    recipe: str | None  # None: not run
    needs: tuple[str, ...] = ()
    reason: str = ""  # why it is not run
    page: str = "README.md"  # the file it is in, relative to the repository


def documentation_pages() -> list[Path]:
    """README, then the site's pages in the order of mkdocs.yml's nav."""
    import yaml

    def walk(entry):
        if isinstance(entry, str):
            yield entry
        elif isinstance(entry, dict):
            for value in entry.values():
                yield from walk(value)
        else:
            for item in entry:
                yield from walk(item)

    site = yaml.safe_load(MKDOCS.read_text())
    docs = REPO_ROOT / site.get("docs_dir", "docs")
    return [README] + [docs / page for page in walk(site["nav"])]


def documentation_blocks() -> list[Block]:
    """Every page's blocks, in documentation_pages' order, each knowing its page."""
    return [dataclasses.replace(block, page=str(page.relative_to(REPO_ROOT)))
            for page in documentation_pages() for block in readme_blocks(page.read_text())]


def readme_blocks(text: str) -> list[Block]:
    """Every ```bash / ```python block, with the recipe or not-run comment among the HTML comments just above it."""
    blocks = []
    for fence in FENCE.finditer(text):
        if fence.group(1) in ("bash", "python"):
            above = reversed(text[:fence.start()].split("\n")[:-1])
            comments = list(itertools.takewhile(lambda line: line.startswith("<!--"), above))
            line = text.count("\n", 0, fence.start()) + 1
            blocks.append(_block(line, fence.group(1), fence.group(2).rstrip("\n"), comments))
    return blocks


def _block(line: int, language: str, code: str, comments: list[str]) -> Block:
    for comment in comments:
        recipe = re.fullmatch(r"<!-- recipe: ([\w-]+)(?:; needs: ([\w, ]+))? -->", comment)
        if recipe:
            needs = tuple(name.strip() for name in (recipe.group(2) or "").split(",") if name.strip())
            return Block(line, language, code, recipe.group(1), needs)
        if comment.startswith(f"<!-- {NOT_RUN}"):
            return Block(line, language, code, None, reason=comment[len(f"<!-- {NOT_RUN}"):-3].strip())
    return Block(line, language, code, None)


def test_every_block_is_a_recipe_or_says_why_not():
    blocks = documentation_blocks()
    assert any(block.page == "README.md" for block in blocks) and any(block.page != "README.md" for block in blocks)
    unmarked = [f"{block.page}:{block.line}" for block in blocks if block.recipe is None and not block.reason]
    assert not unmarked, (f"code blocks at {unmarked} have neither <!-- recipe: NAME --> nor "
                          f"<!-- {NOT_RUN} REASON --> above them")
    names = [block.recipe for block in blocks if block.recipe]
    assert len(names) == len(set(names)), f"recipe names repeat: {names}"
    recipes = {block.recipe: block.code for block in blocks if block.recipe}
    for where, printed, _ in SIZES:
        assert where in recipes or (REPO_ROOT / where).is_file(), f"SIZES: {where} is neither a recipe nor a file"
        text = recipes[where] if where in recipes else (REPO_ROOT / where).read_text()
        assert printed in text, f"SIZES: {printed!r} is not in {where} (the docs changed: update the table)"


def test_the_block_reader_sees_markers_and_unmarked_blocks():
    text = ("<!-- recipe: a; needs: torch, wandb -->\n```bash\necho a\n```\n\n```text\nnot code\n```\n"
            f"<!-- {NOT_RUN} a cluster -->\n```bash\nsrun x\n```\n```python\nprint(1)\n```\n")
    a, cluster, unmarked = readme_blocks(text)
    assert (a.recipe, a.needs, a.code) == ("a", ("torch", "wandb"), "echo a")
    assert (cluster.recipe, cluster.reason, unmarked.recipe, unmarked.reason) == (None, "a cluster", None, "")


def sized(code: str, recipe: str) -> str:
    for where, printed, ci in SIZES:
        if where == recipe:
            code = code.replace(printed, ci)
    return code


def user_files(cwd: Path) -> None:
    """What README asks users to bring, at the paths it names: Hugging Face DiffLlama / Llama directories (small,
    random, vocabulary 257 = the byte tokenizer's, weights large enough that top-1 predictions are not ties), a
    unilm attention state_dict saved with torch.save, and JSON-lines text."""
    from flax import nnx

    import diffjax
    from diffjax.model.attention.diff import DiffAttention

    config = diffjax.ModelConfig(vocab_size=257, d_model=64, num_layers=2, num_heads=4, max_seq_len=512, init_std=0.15)
    diffjax.save_hf(diffjax.TransformerLM(config, rngs=nnx.Rngs(0)), cwd / "path/to/DiffLlama")
    twin = config.replace(attention="standard", num_heads=8)
    diffjax.save_hf(diffjax.TransformerLM(twin, rngs=nnx.Rngs(1)), cwd / "path/to/Llama")
    if importlib.util.find_spec("torch"):
        import numpy as np
        import torch

        from diffjax.convert import unilm_attention_state_dict

        layer = DiffAttention(config, depth=3, rngs=nnx.Rngs(2))
        state = {key: torch.from_numpy(np.array(value)) for key, value in unilm_attention_state_dict(layer).items()}
        torch.save(state, cwd / "attn.pt")
    (cwd / "my").mkdir()
    source = (REPO_ROOT / "diffjax" / "config.py").read_text()
    (cwd / "my" / "code.jsonl").write_text("".join(json.dumps({"text": source[i:i + 2000]}) + "\n"
                                                   for i in range(0, len(source), 2000)))


def run_recipe(block: Block, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    code = sized(block.code, block.recipe)
    if block.language == "python":
        script = cwd / f"recipe_{block.recipe}.py"
        script.write_text(code + "\n")
        command = [sys.executable, script.name]
    else:
        command = ["bash", "-euo", "pipefail", "-c", code]
    return subprocess.run(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=600)


def recipe_env(cwd: Path) -> dict:
    """The test session's environment (its compilation cache, no downloads), as a user's machine: one CPU device;
    the copy of the package in `cwd` imported first."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(cwd), os.environ.get("PYTHONPATH")])),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true",
           "WANDB_DIR": str(cwd), "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])}
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", "")).strip()
    return env


def page_directory(shared: Path, page: str) -> Path:
    """A fresh directory for the recipes of `page`: links to everything in `shared` (the package, the user's files,
    runs/); what the page writes beside them stays in it."""
    cwd = shared.parent / "pages" / page.replace("/", "_").removesuffix(".md")
    cwd.mkdir(parents=True)
    for entry in shared.iterdir():
        (cwd / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
    return cwd


def test_a_page_directory_holds_the_shared_entries_and_nothing_another_page_wrote(tmp_path):
    shared = tmp_path / "shared"
    (shared / "runs").mkdir(parents=True)
    (shared / "train.py").write_text("")
    first = page_directory(shared, "docs/a.md")
    (first / "out").mkdir()
    (first / "runs" / "tiny").mkdir()
    second = page_directory(shared, "docs/b.md")
    assert sorted(p.name for p in second.iterdir()) == ["runs", "train.py"] and (second / "runs" / "tiny").is_dir()


@pytest.mark.slow
def test_readme_recipes_run_as_printed(tmp_path):
    shared = tmp_path / "shared"
    (shared / "runs").mkdir(parents=True)
    for name in COPIED:
        if (REPO_ROOT / name).is_dir():
            shutil.copytree(REPO_ROOT / name, shared / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(REPO_ROOT / name, shared / name)
    for where, printed, ci in SIZES:
        if (shared / where).is_file():
            (shared / where).write_text((shared / where).read_text().replace(printed, ci))
    user_files(shared)
    failures, skipped, directories = [], [], {}
    chosen = {page.strip() for page in os.environ.get("RECIPE_PAGES", "").split(",") if page.strip()}
    blocks = documentation_blocks()
    assert chosen <= {block.page for block in blocks}, f"RECIPE_PAGES: no such page {sorted(chosen - {b.page for b in blocks})}"
    for block in blocks:
        if block.recipe is None or (chosen and block.page not in chosen | {"README.md"}):
            continue
        if block.page not in directories:
            directories[block.page] = page_directory(shared, block.page)
        cwd = directories[block.page]
        env = recipe_env(cwd)
        missing = [name for name in block.needs if importlib.util.find_spec(name) is None]
        if missing:
            skipped.append(f"{block.recipe} (needs {', '.join(missing)})")
            continue
        start = time.monotonic()
        result = run_recipe(block, cwd, env)
        print(f"recipe {block.recipe}: exit {result.returncode} in {time.monotonic() - start:.0f} s", flush=True)
        marker = FAILURE_MARKERS.search(result.stdout)
        if result.returncode != 0 or marker:
            why = f"exit {result.returncode}" if result.returncode else f"printed {marker.group(0)!r}"
            failures.append(f"recipe {block.recipe} ({block.page} line {block.line}): {why}\n{result.stdout[-2500:]}")
    print("skipped:", skipped or "none")
    assert not failures, "\n\n".join(failures)
