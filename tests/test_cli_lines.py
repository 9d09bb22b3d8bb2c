"""Issue 62, items 3 and 4: every command line takes its options as spelled (no abbreviations: `--o` replaced an
export, `--max` ran as `--max-new-tokens`), says a misspelled one in one line with what was meant, and ends on
Ctrl-C, a closed pipe or a full disk with one line (or none) and a status, never a traceback or a signal death.
The parsers are the ones each main builds (test_cli_help.parser_of); the endings run as real processes."""

from __future__ import annotations

import argparse
import ast
import os
import re
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from diffjax import command_line
from test_cli_help import COMMANDS, MAINS, parser_of

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def _parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(the subcommand names that reach it, parser) for a parser and each of its subcommands'."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, path + (name,))


def _error(parse, argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit:
        parse(argv)
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line, no usage block
    return err


@pytest.mark.parametrize("command", sorted(MAINS))
def test_no_option_is_abbreviated_and_a_misspelled_one_names_the_option(command, capsys):
    with pytest.MonkeyPatch.context() as patch:
        top = parser_of(MAINS[command], patch)
    # the parse a main runs: intermixed where it takes positionals among options (diffjax-train)
    parses = [top.parse_args] + ([] if top._subparsers else [top.parse_intermixed_args])
    for path, parser in _parsers(top):
        assert isinstance(parser, command_line.ArgumentParser) and not parser.allow_abbrev, (command, path)
        known = parser._option_string_actions
        for option in (o for o in known if o.startswith("--")):
            swapped = option[:-2] + option[-1] + option[-2]  # a typo: the last two letters swapped
            for parse in parses:
                for prefix in (option[:k] for k in range(3, len(option)) if option[:k] not in known):
                    line = _error(parse, [*path, prefix, "x"], capsys)
                    assert f"error: unrecognized option {prefix} (options are not abbreviated: did you mean " in line
                if option[:-1] not in known:  # the --option=value form too
                    assert f"unrecognized option {option[:-1]} " in _error(parse, [*path, f"{option[:-1]}=x"], capsys)
                if swapped not in known:
                    assert option in _error(parse, [*path, swapped], capsys)


def test_a_value_outside_the_choices_names_the_closest(capsys):
    from diffjax.console_scripts import convert
    from diffjax.train.cli import main

    assert "invalid choice: 'h10' " in _error(main, ["--plan", "--device", "h10"], capsys)
    assert "(did you mean h100?)" in _error(main, ["--plan", "--device", "h10"], capsys)
    assert "(did you mean diffjax-to-hf?)" in _error(convert, ["diffjax-to-fh", "a", "b"], capsys)


def test_every_command_line_ends_through_the_runner_and_builds_the_shared_parser():
    """The console scripts and every module's `if __name__ == "__main__":` call command_line.run (so Ctrl-C,
    closed pipes and full disks end each alike; the console scripts import their command inside it); every command
    test_cli_help walks (the parsers above) is such a module, and none builds argparse's own parser."""
    for script, target in SCRIPTS.items():
        assert target.startswith(("diffjax.console_scripts:", "diffjax.train.cli:run")), script
    ends = {}
    for path in sorted((REPO_ROOT / "diffjax").rglob("*.py")):
        source = path.read_text()
        assert "argparse.ArgumentParser(" not in source or path.name == "command_line.py", path
        for node in ast.parse(source).body:
            if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
                module = ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts).removesuffix(".__main__")
                ends[module] = ast.unparse(node.body[-1])
    assert set(COMMANDS) <= set(ends), ends
    assert all(re.match(r"(command_line\.)?run\(main, ", end) for end in ends.values()), ends


def _python(code: str, **popen) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.Popen([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, **{"text": True, **popen})


def _interrupted_when_it_says(code: str, timeout: float = 240, send: bool = True) -> tuple[int, str]:
    """Runs `code`, sends SIGINT (unless `code` sends its own) when its stderr's first line comes (it is busy then),
    returns (status, the rest of stderr)."""
    # unbuffered: readline reads up to the newline only, leaving the rest to communicate
    process = _python(code, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=False, bufsize=0)
    ready = process.stderr.readline().decode()
    assert ready.startswith("busy"), ready + process.stderr.read().decode()
    if send:
        process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=timeout)
    return process.returncode, err.decode()


# --plan's XLA compilation of the train step announces itself, then compiles
PLAN = """
import sys, time
import jax
from diffjax.train import cli
compile = jax.stages.Lowered.compile
def announced(self, *args, **kwargs):
    print("busy: compiling", file=sys.stderr, flush=True)
    time.sleep(float(sys.argv[1]))
    return compile(self, *args, **kwargs)
jax.stages.Lowered.compile = announced
cli.run(["--plan", "--config", "tiny"])
"""


@pytest.mark.slow
def test_ctrl_c_while_the_plan_compiles_is_one_line_and_status_130():
    """Before: a 40-line traceback, then a segfault (rc -11, 5 of 5 by hand; 3 of 3 here), also when the
    KeyboardInterrupt was caught and the process exited normally: the interrupted compilation's threads ran on.
    The signal lands in the compilation (sent as it starts), or just before it."""
    for delay in ("0", "0.5"):
        code, err = _interrupted_when_it_says(PLAN.replace("sys.argv[1]", delay))
        assert (code, err) == (130, "diffjax-train: interrupted (SIGINT)\n")


def test_ctrl_c_during_help_keys_and_while_jax_loads_is_one_line_and_status_130():
    """--help-keys interrupted as it describes the keys (the signal sent from inside, at that point); diffjax-generate
    interrupted while its imports load jax (seconds)."""
    code, err = _interrupted_when_it_says("""
import os, signal, sys
from diffjax.train import cli, keys
describe_keys = keys.describe_keys
def interrupted(config):
    print("busy", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGINT)
    return describe_keys(config)
keys.describe_keys = interrupted
cli.run(["--help-keys"])
""", send=False)
    assert (code, err) == (130, "diffjax-train: interrupted (SIGINT)\n")
    code, err = _interrupted_when_it_says("""
import importlib, sys, types
from diffjax import console_scripts
def announced(name):
    print("busy: importing", name, file=sys.stderr, flush=True)
    return importlib.import_module(name)
console_scripts.importlib = types.SimpleNamespace(import_module=announced)
console_scripts.generate(["--checkpoint", "nowhere", "--prompt", "hi"])
""")
    assert (code, err) == (130, "diffjax-generate: interrupted (SIGINT)\n")


def _closed_pipe() -> int:
    read, write = os.pipe()
    os.close(read)
    return write


@pytest.mark.parametrize("command", [
    "from diffjax.train.cli import run; run(['--help-keys'])",
    "from diffjax.train.cli import run; run(['--help'])",
    "from diffjax.console_scripts import evaluate; evaluate(['--help'])",
])
def test_a_closed_pipe_ends_quietly_and_a_full_disk_in_one_line(command):
    """`diffjax-train --help-keys | head -1` once head has exited (the pipe's reader closed): no output, status 0,
    as a command killed by SIGPIPE looks to the shell; `> /dev/full`: one line, status 1. Before: a traceback."""
    write = _closed_pipe()
    process = _python(command, stdout=write, stderr=subprocess.PIPE)
    os.close(write)
    _, err = process.communicate(timeout=120)
    assert (process.returncode, err) == (0, "")
    if Path("/dev/full").exists():
        with open("/dev/full", "w") as full:
            process = _python(command, stdout=full, stderr=subprocess.PIPE)
            _, err = process.communicate(timeout=120)
        prog = "diffjax-eval" if "evaluate" in command else "diffjax-train"
        assert (process.returncode, err) == (1, f"{prog}: error: cannot write to stdout (No space left on device)\n")


def test_head_reads_the_first_line_of_help_keys():
    done = subprocess.run(f"{sys.executable} train.py --help-keys | head -1", shell=True, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert done.returncode == 0 and done.stdout.count("\n") == 1 and done.stderr == "", done.stderr
