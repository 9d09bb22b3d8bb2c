"""Every Hugging Face export carries a model card (diffjax.convert.model_card): README.md whose metadata the Hub's own
parser (huggingface_hub.ModelCard) reads (license, library, tags), saying what the model is, where it came from, which
diffjax wrote it and how to load it; a converted source's card gives its license and follows. `diffjax-convert
diffjax-to-hf ... --push-to-hub ORG/NAME` uploads the export through huggingface_hub's create_repo + upload_folder,
mocked here at that call site (the network is closed): what is refused is refused before anything is written, and a
failed upload is one line."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
from flax import nnx

import diffjax
from diffjax.convert.__main__ import main

huggingface_hub = pytest.importorskip("huggingface_hub")

SOURCE_CARD = "---\nlicense: llama3.1\nlanguage: [en]\n---\n# The source\n\nIts authors' terms of use.\n"


def safetensors_elements(path: Path) -> int:
    """Elements of every tensor in a safetensors file, from its header (8 bytes of length, then JSON)."""
    data = path.read_bytes()
    header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
    return sum(math.prod(entry["shape"]) for name, entry in header.items() if name != "__metadata__")


def card_of(directory: Path):
    return huggingface_hub.ModelCard.load(directory / "README.md")


@pytest.fixture(scope="module")
def model():
    config = diffjax.ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=2, max_seq_len=64)
    return diffjax.TransformerLM(config, rngs=nnx.Rngs(0))


@pytest.fixture
def converted(model, tmp_path):
    """A run directory converted from an HF directory that has a model card (kept in RUN/hf/)."""
    source = diffjax.save_hf(model, tmp_path / "source")
    (source / "README.md").write_text(SOURCE_CARD)
    assert main(["hf-to-diffjax", str(source), str(tmp_path / "run")]) == 0
    return tmp_path / "run"


@pytest.fixture
def online(monkeypatch):
    for variable in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)


def test_save_hf_writes_a_model_card_the_hub_reads(model, tmp_path):
    out = diffjax.save_hf(model, tmp_path / "export", license="apache-2.0")
    card, config_json = card_of(out), json.loads((out / "config.json").read_text())
    assert card.data.license == "apache-2.0" and card.data.library_name == "transformers"
    assert config_json["model_type"].lower() in card.data.tags and "diffjax" in card.data.tags
    text = card.text
    assert f"diffjax) {diffjax.__version__} from a diffjax model" in text
    for row in (f"| parameters | {safetensors_elements(out / 'model.safetensors'):,} (float32) |",
                "| layers | 2 |", "| hidden size | 32 |", "| vocabulary | 64 |"):
        assert row in text, row
    assert f'AutoModelForCausalLM.from_pretrained("{out}")' in text
    assert diffjax.load_hf(out).num_params() == model.num_params()  # the card changes nothing that loads
    unlicensed = card_of(diffjax.save_hf(model, tmp_path / "unlicensed"))
    assert unlicensed.data.license == "unknown" and "Not recorded: set it before publishing" in unlicensed.text
    with pytest.raises(ValueError, match="--license 'Apache 2' is not a Hub license identifier"):
        diffjax.save_hf(model, tmp_path / "refused", license="Apache 2")
    assert not (tmp_path / "refused").exists()


def test_an_export_of_a_conversion_keeps_the_source_cards_license_and_terms(converted, tmp_path, capsys):
    assert main(["diffjax-to-hf", str(converted), str(tmp_path / "export")]) == 0
    card = card_of(tmp_path / "export")
    assert card.data.license == "llama3.1" and "from the source's model card" in card.text
    assert "## The source's model card" in card.text and "Its authors' terms of use." in card.text
    assert f"the diffjax checkpoint `{converted / 'checkpoints' / '0'}`" in card.text
    assert "its model card: README.md" in capsys.readouterr().out
    assert main(["diffjax-to-hf", str(converted), str(tmp_path / "mit"), "--license", "mit"]) == 0
    assert card_of(tmp_path / "mit").data.license == "mit"


class FakeHfApi:
    """huggingface_hub.HfApi at the call site diffjax.convert.hub.push makes: records calls, uploads nothing."""

    calls: list = []
    fail_with = None

    def create_repo(self, repo_id, **kwargs):
        FakeHfApi.calls.append(("create_repo", repo_id, kwargs))

    def upload_folder(self, **kwargs):
        FakeHfApi.calls.append(("upload_folder", kwargs["repo_id"], kwargs))
        if FakeHfApi.fail_with is not None:
            raise FakeHfApi.fail_with
        return SimpleNamespace(commit_url=f"https://huggingface.co/{kwargs['repo_id']}/commit/1234")


@pytest.fixture
def fake_hub(monkeypatch, online):
    FakeHfApi.calls, FakeHfApi.fail_with = [], None
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeHfApi)
    return FakeHfApi


def test_push_to_hub_uploads_the_export_with_its_card(converted, tmp_path, fake_hub, capsys):
    out = tmp_path / "export"
    assert main(["diffjax-to-hf", str(converted), str(out), "--push-to-hub", "diffjax-tests/pushed", "--private"]) == 0
    (_, repo, create), (_, uploaded, upload) = fake_hub.calls
    assert (repo, create["private"], create["exist_ok"], create["repo_type"]) == ("diffjax-tests/pushed", True, True, "model")
    assert uploaded == "diffjax-tests/pushed" and Path(upload["folder_path"]) == out
    assert {"config.json", "model.safetensors", "README.md"} <= {p.name for p in out.iterdir()}
    assert 'from_pretrained("diffjax-tests/pushed")' in card_of(out).text
    assert "pushed" in capsys.readouterr().out


@pytest.mark.parametrize("arguments, message", [
    (["--push-to-hub", "not a repo id"], "--push-to-hub 'not a repo id' is not a Hub repository id"),
    (["--private"], "--private goes with --push-to-hub"),
    (["--push-to-hub", "diffjax-tests/pushed", "--license", "Apache 2"], "is not a Hub license identifier"),
])
def test_what_push_refuses_it_refuses_before_writing(converted, tmp_path, fake_hub, capsys, arguments, message):
    assert main(["diffjax-to-hf", str(converted), str(tmp_path / "export"), *arguments]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and not (tmp_path / "export").exists() and not fake_hub.calls


def test_push_offline_is_refused_before_writing(converted, tmp_path, fake_hub, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["diffjax-to-hf", str(converted), str(tmp_path / "export"), "--push-to-hub", "diffjax-tests/x"]) == 2
    assert "offline mode is on (HF_HUB_OFFLINE set in your environment); unset it to upload" in capsys.readouterr().err
    assert not (tmp_path / "export").exists() and not fake_hub.calls


def test_a_failed_upload_is_one_line_and_keeps_the_export(converted, tmp_path, fake_hub, capsys):
    response = SimpleNamespace(status_code=403, headers={}, request=None)
    fake_hub.fail_with = huggingface_hub.errors.HfHubHTTPError("403 Forbidden", response=response)
    out = tmp_path / "export"
    assert main(["diffjax-to-hf", str(converted), str(out), "--push-to-hub", "diffjax-tests/pushed"]) == 1
    err = capsys.readouterr().err
    assert "the token may not write there" in err and f"`hf upload diffjax-tests/pushed {out}`" in err
    assert [line for line in err.splitlines() if not line.startswith("  [")] == [err.splitlines()[-1]]  # (progress)
    assert (out / "config.json").is_file()
