"""The model card (README.md) every Hugging Face export carries, as the Hub and transformers users expect one: its
metadata (library, license, pipeline, tags) in YAML front matter; what the model is (its format and the kinds of its
blocks), where the weights came from and which diffjax wrote them, a summary of its configuration, and how to load
it with transformers and with diffjax. A source's own card (kept beside a conversion, RUN/hf/README.md) gives its
license and follows below, so that its terms travel with the weights."""

from __future__ import annotations

import re
import sys

import yaml

from diffjax.config import BLOCK_PARTS, ModelConfig
from diffjax.convert.formats import CheckpointFormat

CARD_FILE = "README.md"
REPOSITORY = "https://github.com/diffjax/diffjax"
LICENSE_KEYS = ("license", "license_name", "license_link")  # the Hub's license metadata
_LICENSE_ID = re.compile(r"^[a-z0-9][a-z0-9.\-]*$")  # the Hub's license identifiers: apache-2.0, llama3.1, other


def check_license(license_id: str) -> str:
    if not _LICENSE_ID.match(license_id):
        raise ValueError(f"--license {license_id!r} is not a Hub license identifier (lower case, e.g. apache-2.0, "
                         "mit, cc-by-4.0, other)")
    return license_id


def split_card(text: str) -> tuple[dict, str]:
    """(metadata, body) of a model card: its YAML front matter ({} without one or when it does not parse) and the
    Markdown after it."""
    match = re.match(r"\A---\s*\n(.*?)\n---\s*(?:\n|\Z)", text, re.DOTALL)
    if not match:
        return {}, text
    try:
        metadata = yaml.safe_load(match.group(1))
    except yaml.YAMLError:
        metadata = None
    return (metadata if isinstance(metadata, dict) else {}), text[match.end():]


def model_card(config: ModelConfig, fmt: CheckpointFormat, *, parameters: int, dtype: str, source: str, name: str,
               license_id: str | None = None, source_card: str | None = None) -> str:
    """README.md for the export of `config` (in format `fmt`, `parameters` weights of `dtype`) from `source` (a
    phrase), loaded as `name` (its directory or Hub id). license_id: the Hub's license identifier (None: the source
    card's, else "unknown")."""
    version = sys.modules[__name__.partition(".")[0]].__version__  # the package's, loaded first (no upward import)
    source_metadata, source_body = split_card(source_card) if source_card else ({}, "")
    licensing = {key: source_metadata[key] for key in LICENSE_KEYS if key in source_metadata}
    if license_id is not None:
        licensing = {"license": check_license(license_id)}
    licensing.setdefault("license", "unknown")
    model_type = fmt.spelling or fmt.model_type
    metadata = {"library_name": "transformers", **licensing, "pipeline_tag": "text-generation",
                "tags": ["diffjax", model_type]}
    kinds = {part: BLOCK_PARTS[part].get(getattr(config, part)).label for part in BLOCK_PARTS}
    remote = ", trust_remote_code=True" if fmt.remote_code else ""
    lines = [
        "---", yaml.safe_dump(metadata, sort_keys=False).rstrip("\n"), "---", "",
        f"# {name.rstrip('/').split('/')[-1]}", "",
        f"A {fmt.label} causal language model in the Hugging Face format (`model_type: {model_type}`, "
        f"`{fmt.architecture}`), written by [diffjax]({REPOSITORY}) {version} from {source}.", "",
        "| | |", "|---|---|",
        f"| parameters | {parameters:,} ({dtype}) |",
        f"| layers | {config.num_layers} |",
        f"| hidden size | {config.d_model} |",
        f"| attention | {kinds['attention']}: {config.num_heads} heads, {config.num_kv_heads} key-value heads, head "
        f"dim {config.head_dim} |",
        f"| MLP | {kinds['mlp']}, width {config.mlp_dim} |",
        f"| residual | {kinds['residual']} |",
        f"| vocabulary | {config.vocab_size:,} |",
        f"| positions | {config.max_seq_len:,} (RoPE theta {config.rope_theta:g}) |", "",
        "## Load it", "",
        "```python",
        "from transformers import AutoModelForCausalLM", "",
        f'model = AutoModelForCausalLM.from_pretrained("{name}"{remote})',
        "```", "",
        f'With diffjax (JAX): `diffjax.load_hf("{name}")`; `diffjax-convert hf-to-diffjax {name} RUN_DIR` makes a run '
        "directory to train on.", "",
        "## License", "", _license_line(licensing, inherited=license_id is None and "license" in source_metadata),
    ]
    if source_body.strip():
        lines += ["", "## The source's model card", "", source_body.strip()]
    return "\n".join(lines) + "\n"


def _license_line(licensing: dict, *, inherited: bool) -> str:
    if licensing["license"] == "unknown":
        return ("Not recorded: set it before publishing (`diffjax-convert diffjax-to-hf ... --license ID`, the "
                "source's terms permitting).")
    named = f" ({licensing['license_name']})" if "license_name" in licensing else ""
    return f"`{licensing['license']}`{named}" + (", from the source's model card." if inherited else ".")
