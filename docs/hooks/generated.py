"""MkDocs hook: the parts of pages that are generated from the code at build time, so that no page copies a table
the code already holds. A page asks for one with a line of its own:

    <!-- generated: config-reference -->     every run-config key (diffjax.train.keys: what --help-keys prints) and
                                             every kind's options: type, default, allowed values, meaning
    <!-- generated: kinds attention -->      the registered kinds of a block part (attention, mlp, residual)
"""

from __future__ import annotations

import dataclasses
import html
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the checkout's diffjax, installed or not

MARKER = re.compile(r"^<!-- generated: ([\w-]+)(?: (\w+))? -->$", re.MULTILINE)


def cell(text: str) -> str:
    """Text safe in a Markdown table cell: pipes escaped, angle brackets as entities."""
    return html.escape(str(text), quote=False).replace("|", "\\|")


def code(value, *, unbroken: bool = False) -> str:
    """Code in a table cell: an HTML element with pipes and backslashes as entities (a Markdown code span would show
    an escaped pipe as written); `unbroken`: never wrapped (the theme breaks code anywhere, `vocab_siz|e`)."""
    start = '<code style="white-space: nowrap">' if unbroken else "<code>"
    return start + html.escape(str(value), quote=False).replace("|", "&#124;").replace("\\", "&#92;") + "</code>"


def key_table(keys, *, strip: str) -> list[str]:
    rows = ["| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
    for key in keys:
        default = "(required)" if key.default is dataclasses.MISSING else code(repr(key.default))
        allowed = ", ".join(code(name) for name in key.allowed) if key.allowed else ""
        rows.append(f"| {code(key.name[len(strip):], unbroken=True)} | {code(key.type)} | {default} | {allowed} | "
                    f"{cell(key.description)} |")
    return rows + [""]


def first_paragraph(cls) -> str:
    return (cls.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ") if cls.__doc__ else ""


def config_reference(_arg) -> str:
    from diffjax.train.config import RunConfig
    from diffjax.train.keys import config_keys, kinds_with_options, option_keys

    sections: dict[str, list] = {}
    for key in config_keys(RunConfig()):
        parts = key.name.split(".")
        section = ".".join(parts[:-1])
        sections.setdefault(section, []).append(key)
    out = []
    for section, keys in sections.items():
        cls = _section_class(RunConfig(), section)
        out += [f"## `{section}`", "", f"{cell(first_paragraph(cls))} (`{cls.__module__}.{cls.__name__}`)", ""]
        out += key_table(keys, strip=section + ".")
    out += ["## Options of the kinds", "",
            "A kind's own settings, read by nothing but that kind: `model.<part>_options` (a mapping in YAML, "
            "`model.attention_options.num_noise_heads=8` on the command line).", ""]
    for part, row in kinds_with_options():
        out += [f"### `model.{part}: {row.name}` ({cell(row.label)})", "",
                f"{cell(first_paragraph(row.options))} (`{row.options.__module__}.{row.options.__name__}`)", ""]
        out += key_table(option_keys(part, row), strip=f"model.{part}_options.")
    return "\n".join(out)


def _section_class(run, section: str) -> type:
    value = run
    for name in section.split("."):
        value = getattr(value, name)
    return type(value)


def kinds_table(part: str) -> str:
    from diffjax.config import BLOCK_PARTS

    if part not in BLOCK_PARTS:
        raise ValueError(f"<!-- generated: kinds {part} -->: the parts are {', '.join(BLOCK_PARTS)}")
    rows = BLOCK_PARTS[part].rows()
    if part == "attention":
        from diffjax.convert import formats, unilm

        lines = ["| `attention` | label | maps | value width | lambda | Hugging Face | unilm | options |",
                 "|---|---|---|---|---|---|---|---|"]
        for row in rows:
            options = f"`{row.options.__name__}`" if row.options else ""
            hf = ", ".join(f.label for f in formats.rows() if f.holds_value("attention", row.name))  # the formats holding it
            modules = ", ".join(module for module, name in unilm.MODULES.items() if name == row.name)
            lines.append(f"| `{row.name}` | {cell(row.label)} | {row.maps} | {row.value_width} | "
                         f"{cell(row.lambda_form)} | {cell(hf)} | {cell(modules)} | {options} |")
    else:
        lines = [f"| `{part}` | label | module | options |", "|---|---|---|---|"]
        for row in rows:
            module = row.module if isinstance(row.module, str) else f"{row.module.__module__}:{row.module.__name__}"
            options = f"`{row.options.__name__}`" if row.options else ""
            lines.append(f"| `{row.name}` | {cell(row.label)} | `{module}` | {options} |")
    return "\n".join(lines)


GENERATORS = {"config-reference": config_reference, "kinds": kinds_table}


def on_page_markdown(markdown: str, page, config, files) -> str:
    def generate(match: re.Match) -> str:
        name, argument = match.groups()
        if name not in GENERATORS:
            raise ValueError(f"{page.file.src_path}: no generator {name!r} (known: {', '.join(GENERATORS)})")
        return GENERATORS[name](argument)

    return MARKER.sub(generate, markdown)


RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def on_files(files, config):
    """The benchmarks' committed figures (benchmarks/results/*.png, drawn by benchmarks/plot_results.py) join the site
    as results/NAME.png, so pages embed them without a copy under docs/ (and a missing one fails the strict build)."""
    from mkdocs.structure.files import File

    for png in sorted(RESULTS.glob("*.png")):
        files.append(File.generated(config, f"results/{png.name}", abs_src_path=str(png)))
    return files
