"""Every `python -m diffjax...` command answers --help with its usage (run as `python -m` runs it: runpy with
run_name "__main__"), and the analyses' library modules say what to run instead of printing nothing."""

from __future__ import annotations

import runpy
import sys
import warnings

import pytest

COMMANDS = ["diffjax.analysis.needles", "diffjax.analysis.recall", "diffjax.analysis.attention_scores",
            "diffjax.analysis.outliers", "diffjax.analysis.quantization", "diffjax.analysis.probe", "diffjax.eval",
            "diffjax.generate", "diffjax.convert", "diffjax.ops", "diffjax.tokenizers"]


def run_module(module: str, argv: list[str], monkeypatch) -> int:
    monkeypatch.setattr(sys, "argv", [module, *argv])
    with warnings.catch_warnings(), pytest.raises(SystemExit) as exit:
        warnings.simplefilter("ignore", RuntimeWarning)  # runpy: "found in sys.modules" (imported by an earlier test)
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    return exit.value.code


@pytest.mark.parametrize("module", COMMANDS)
def test_help_prints_the_usage(module, monkeypatch, capsys):
    assert run_module(module, ["--help"], monkeypatch) == 0
    assert capsys.readouterr().out.startswith(f"usage: python -m {module} ")


def test_the_probe_library_names_the_commands_that_use_it(monkeypatch, capsys):
    assert run_module("diffjax.analysis.probe", [], monkeypatch) == 2
    assert "no command line of its own" in capsys.readouterr().err


def test_recall_writes_training_documents_the_trainer_reads(tmp_path, monkeypatch, capsys):
    import json

    from diffjax.analysis.recall import main
    from diffjax.data.segments import parse_segments

    out = tmp_path / "recall.jsonl"
    assert main(["--write-training", str(out), "--count", "5", "--pairs", "4,8"]) == 0
    lines = out.read_text().splitlines()
    assert len(lines) == 5 and capsys.readouterr().out == f"wrote 5 documents to {out}\n"
    for line in lines:  # the trainer's jsonl source reads each, and each has answers to learn
        segments = parse_segments(json.loads(line)["segments"], fail=pytest.fail)
        assert any(label for _, label in segments) and not all(label for _, label in segments)
