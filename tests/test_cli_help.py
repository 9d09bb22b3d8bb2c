"""Every command answers --help with its usage under the one name users type (a console script's name for the tools
pyproject installs, `python -m <module>` for the others; run as `python -m` runs it: runpy with run_name
"__main__"), every option of every command says what it does, and the analyses' library modules say what to run
instead of printing nothing."""

from __future__ import annotations

import argparse
import importlib
import runpy
import sys
import tomllib
import warnings
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
# The console scripts: name -> "module:function" (diffjax-train, diffjax-convert, ...).
SCRIPTS = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["scripts"]
# What `python -m` runs, and the name its usage line gives: the console script's where one runs the same main.
COMMANDS = {"diffjax.analysis.needles": None, "diffjax.analysis.recall": None, "diffjax.analysis.attention_scores": None,
            "diffjax.analysis.outliers": None, "diffjax.analysis.quantization": None, "diffjax.analysis.probe": None,
            "diffjax.eval": "diffjax-eval", "diffjax.generate": "diffjax-generate", "diffjax.convert": "diffjax-convert",
            "diffjax.checkpoint": "diffjax-checkpoint", "diffjax.data": None}
# Every command line's main: the console scripts' and the modules'.
MAINS = {**{name: target for name, target in SCRIPTS.items()},
         **{f"python -m {module}": f"{module}.__main__:main" if module in ("diffjax.data",)
            else f"{module}:main" for module, script in COMMANDS.items() if script is None}}


class _Built(Exception):
    """Raised by the first parse: carries the parser a main built."""


def parser_of(target: str, monkeypatch) -> argparse.ArgumentParser:
    """The ArgumentParser the main `target` ("module:function") builds, taken at its first parse (nothing runs)."""
    module, function = target.split(":")

    def capture(parser, *args, **kwargs):
        raise _Built(parser)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", capture)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_intermixed_args", capture)
    with pytest.raises(_Built) as built:
        getattr(importlib.import_module(module), function)([])
    return built.value.args[0]


def options_without_help(parser: argparse.ArgumentParser) -> list[str]:
    """'PROG --option' (or a positional's name) for each argument of the parser and its subcommands that has no help."""
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            missing += [name for sub in action.choices.values() for name in options_without_help(sub)]
        elif not action.help:
            missing.append(f"{parser.prog} {'/'.join(action.option_strings) or action.dest}")
    return missing


@pytest.mark.parametrize("command", sorted(MAINS))
def test_every_option_has_help_and_the_usage_names_the_command(command, monkeypatch):
    parser = parser_of(MAINS[command], monkeypatch)
    assert parser.prog == command
    assert options_without_help(parser) == []


def run_module(module: str, argv: list[str], monkeypatch) -> int:
    monkeypatch.setattr(sys, "argv", [module, *argv])
    with warnings.catch_warnings(), pytest.raises(SystemExit) as exit:
        warnings.simplefilter("ignore", RuntimeWarning)  # runpy: "found in sys.modules" (imported by an earlier test)
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    return exit.value.code


@pytest.mark.parametrize("module", sorted(COMMANDS))
def test_help_prints_the_usage(module, monkeypatch, capsys):
    assert run_module(module, ["--help"], monkeypatch) == 0
    assert capsys.readouterr().out.startswith(f"usage: {COMMANDS[module] or f'python -m {module}'} ")


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


def test_the_trainer_ends_its_process_with_main_s_exit_status(monkeypatch, capsys):
    """diffjax-train / train.py end with os._exit (no interpreter teardown, where a native thread wanting the GIL
    could abort a finished run) carrying main's status, after the output is flushed."""
    from diffjax import command_line
    from diffjax.train import cli

    ended = []

    def exit_(code):
        ended.append(code)
        raise SystemExit(code)  # (what os._exit never returns from)

    monkeypatch.setattr(command_line.os, "_exit", exit_)
    monkeypatch.setattr(command_line.logging, "shutdown", lambda: None)  # (it would close pytest's own log handlers)
    for argv in (["--help-keys", "model.d_model=48"], ["model.no_such_key=1"]):
        with pytest.raises(SystemExit):
            cli.run(argv)
    assert ended == [0, 2]
    out, err = capsys.readouterr()
    assert "model.d_model" in out and "48" in out and "no_such_key" in err
