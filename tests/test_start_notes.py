"""What a start says and leaves: the first training of a converted model notes no "changed" settings (it resumes
nothing), a resume names only what the user changed, and a start refused by its set-up leaves no empty run
directory behind (while a directory that was there before stays)."""

from __future__ import annotations

import pytest
from flax import nnx

from diffjax.train import train


def _changed_notes(lines):
    return [line for line in lines if line.startswith("note: resuming with changed")]


@pytest.mark.slow
def test_a_converted_start_notes_no_change_and_a_resume_only_the_users(tmp_path, monkeypatch):
    from test_trainer import _config

    from diffjax.checkpoint import save_params
    from diffjax.model import TransformerLM

    monkeypatch.chdir(tmp_path)
    config = _config("converted", "train.steps=1")  # run_dir as a user types it: relative
    params = nnx.to_pure_dict(nnx.state(TransformerLM(config.model, rngs=nnx.Rngs(0)), nnx.Param))
    save_params("converted", params, config.model)  # what convert hf-to-diffjax / upcycle write
    lines = []
    train(config, log=lines.append)
    assert any("params-only checkpoint" in line for line in lines), lines
    assert _changed_notes(lines) == [], lines  # the converter's config.yaml names other values: nothing resumed

    lines = []
    train(_config(tmp_path / "converted", "train.steps=2", "optim.lr=2e-3"), log=lines.append)  # another spelling
    assert _changed_notes(lines) == ["note: resuming with changed optim.lr, train.steps"], lines


@pytest.mark.parametrize("existed", [False, True], ids=["created", "there-before"])
def test_a_refused_start_leaves_no_empty_run_directory(existed, tmp_path, monkeypatch):
    from test_trainer import _config

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty-cache"))  # cl100k_base is not cached there
    run_dir = tmp_path / "runs" / "tiktoken"
    if existed:  # the user's directory, empty but for a note of theirs
        run_dir.mkdir(parents=True)
        (run_dir / "notes.txt").write_text("mine")
    # (model.vocab_size given: the config does not ask the tokenizer for it, the start does)
    config = _config(run_dir, "data.tokenizer.kind=tiktoken", "data.tokenizer.encoding=cl100k_base",
                     "model.vocab_size=100352")
    with pytest.raises(FileNotFoundError, match="tiktoken encoding 'cl100k_base' is not in the local cache"):
        train(config, log=lambda _: None)
    assert run_dir.exists() == existed and (tmp_path / "runs").exists() == existed  # (runs/ too, when it made it)
    assert not existed or (run_dir / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("broken_line", [2, 70])
def test_a_start_refused_by_its_data_leaves_nothing(broken_line, tmp_path):
    """Issue 62 item 5: a JSONL file broken on line 2 left a run directory (config.yaml, metrics, TensorBoard) behind:
    the first documents and the first batch are read before anything is written. Line 70 of 80: in the first batch."""
    from test_trainer import _config

    lines = [f'{{"text": "document {i} says hello"}}' for i in range(80)]
    lines[broken_line - 1] = '{"text": broken'
    (tmp_path / "data.jsonl").write_text("\n".join(lines) + "\n")
    config = _config(tmp_path / "runs" / "new", "data.source=jsonl", f"data.paths={tmp_path / 'data.jsonl'}",
                     "data.eval_fraction=0")
    with pytest.raises(ValueError, match=f"data.jsonl line {broken_line}: invalid JSON") as raised:
        train(config, log=lambda _: None)
    assert raised.value.during_setup and not (tmp_path / "runs").exists()


def test_a_run_directory_in_the_hugging_face_cache_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    """Issue 62 item 5: train.run_dir inside a model's snapshot trained and wrote a run beside its weights; the
    conversions refuse such a destination, and so does the trainer now (diffjax.convert.hub.refuse_the_cache)."""
    import huggingface_hub
    from test_trainer import _config

    cache = tmp_path / "hf" / "hub"
    snapshot = cache / "models--org--name" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    with pytest.raises(ValueError, match=f"{snapshot / 'run'} is in the Hugging Face cache {cache}") as raised:
        train(_config(snapshot / "run"), log=lambda _: None)
    assert raised.value.during_setup and list(snapshot.iterdir()) == []
