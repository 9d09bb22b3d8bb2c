"""What every diffjax command line shares (no jax: `--help` stays fast).

`ArgumentParser` is the one parser class every command builds (and its subcommands, through argparse's
add_subparsers): options are never abbreviated (`--o` is not `--overwrite`: Python's parser would act on any unique
prefix), an option it does not know is one line naming the ones meant ("did you mean --max-new-tokens?") instead
of the usage block, as is a value outside an option's choices; every other parse error is one line too.

`run(main, prog, argv)` calls a command's main and ends the process the same way whatever stops it:
  - main's exit status (its return value, or argparse's SystemExit), after the output is flushed;
  - Ctrl-C (from anywhere in main: its imports, an XLA compilation): one line, status 130, the process ended at
    once (os._exit, as a kill: nothing saved is touched). Raising KeyboardInterrupt instead unwound an interrupted
    XLA compilation while its threads ran on: `diffjax-train --plan` died of a segfault (exit -11), also when the
    interrupt was caught. The trainer's own handler (diffjax.train.loop.StopSignals) replaces this one while it
    trains, and saves a checkpoint;
  - a closed output pipe (`| head -1`): quietly, status 0, as a command killed by SIGPIPE would look to the shell;
  - output that cannot be written (`> /dev/full`): one line naming the stream, status 1.
The trainer ends every run without the teardown (`end_process=True`, diffjax.train.cli.run).
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import re
import signal
import sys
from typing import Callable, NoReturn

from diffjax.config_values import did_you_mean, meant

# An argument that argparse takes for an option: a dash and a letter (not "-3", a negative number)
_OPTION_LIKE = re.compile(r"^--?[A-Za-z]")


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser with allow_abbrev off and one-line errors (the module docstring). Its parse methods
    refuse unknown options before anything else (a missing required argument included), also in
    parse_known_args: this parser never passes an unknown option on."""

    def __init__(self, *args, allow_abbrev: bool = False, **kwargs):
        super().__init__(*args, allow_abbrev=allow_abbrev, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        self._refuse_unknown_options(args)
        return super().parse_known_args(args, namespace)

    def parse_known_intermixed_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        self._refuse_unknown_options(args)
        return super().parse_known_intermixed_args(args, namespace)

    def _refuse_unknown_options(self, args: list[str]) -> None:
        """error() for the first argument that looks like an option and is none of this parser's, up to "--" or a
        subcommand's name (its own parser checks the rest)."""
        subcommands = {name for action in self._actions if isinstance(action, argparse._SubParsersAction)
                       for name in action.choices}
        known = self._option_string_actions
        for arg in args:
            if arg == "--" or arg in subcommands:
                return
            name = arg.split("=", 1)[0]
            if not _OPTION_LIKE.match(arg) or name in known or (not arg.startswith("--") and arg[:2] in known):
                continue  # (a value, a known option, or a short option with its value attached: -ofile)
            self.error(f"unrecognized option {name}{_meant(name, known)}")

    def _check_value(self, action, value):
        """A value outside an option's (or a subcommand's) choices: argparse's message with the closest named."""
        try:
            super()._check_value(action, value)
        except argparse.ArgumentError as error:
            if action.choices is None:
                raise
            raise argparse.ArgumentError(action, error.message + did_you_mean(value, action.choices)) from None

    def error(self, message: str) -> NoReturn:
        meant = message.endswith("?)")  # (what was meant is said: the usage would only bury it)
        self.exit(2, f"{self.prog}: error: {message}{'' if meant else f' (`{self.prog} --help` shows the usage)'}\n")


def _meant(name: str, known) -> str:
    """' (did you mean ...?)' for an unknown option: the options it abbreviates, else the closest by spelling."""
    longer = sorted(option for option in known if option.startswith(name))
    return meant(longer[:3], "options are not abbreviated: ") if longer else did_you_mean(name, known)


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (counts, sizes, lengths)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


class OutputError(Exception):
    """Writing stdout or stderr failed (deliberately not an OSError: a command's handlers of its own file errors
    must not take it for one of theirs)."""

    def __init__(self, stream: str, error: OSError):
        super().__init__(f"cannot write to {stream} ({error.strerror or error})")
        self.stream, self.error = stream, error


class _GuardedStream:
    """sys.stdout / sys.stderr while a command runs: its write errors become OutputError."""

    def __init__(self, stream, name: str):
        self._stream, self._name = stream, name

    def write(self, text):
        try:
            return self._stream.write(text)
        except OSError as error:
            raise OutputError(self._name, error) from None

    def flush(self):
        try:
            self._stream.flush()
        except OSError as error:
            raise OutputError(self._name, error) from None

    def __getattr__(self, name):
        return getattr(self._stream, name)


def run(main: Callable[[list[str] | None], int | None], prog: str, argv: list[str] | None = None, *,
        end_process: bool = False) -> NoReturn:
    """Runs `main(argv)` and ends the process as the module docstring says; end_process: without Python's
    teardown also when main returns (os._exit, everything a run opened being closed by then)."""
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _GuardedStream(sys.stdout, "stdout"), _GuardedStream(sys.stderr, "stderr")
    interrupt = signal.signal(signal.SIGINT, functools.partial(_stop_at_once, prog, streams))
    try:
        try:
            code = main(argv)
        except SystemExit as exit:
            code = exit.code
        if isinstance(code, str):  # sys.exit("message")
            print(code, file=sys.stderr)
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
    except KeyboardInterrupt:  # (raised otherwise than by SIGINT: _thread.interrupt_main, a library)
        _ignore_interrupts()
        code, end_process = 130, True
        _say(streams[1], f"{prog}: interrupted")
    except OutputError as failed:
        code = 0 if isinstance(failed.error, BrokenPipeError) else 1
        # what is still buffered goes nowhere: the exit's own flush fails no more
        _to_devnull(streams[failed.stream == "stderr"])
        if code:
            _say(streams[1], f"{prog}: error: {failed}")
    finally:
        sys.stdout, sys.stderr = streams
        if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            signal.signal(signal.SIGINT, interrupt)
    if end_process:
        end(code or 0)
    sys.exit(code)


def _stop_at_once(prog: str, streams, signum, frame) -> NoReturn:
    """The SIGINT handler while a command runs: what it printed, one line, then the end (exit 130)."""
    _ignore_interrupts()
    try:
        streams[0].flush()
    except Exception:  # (a closed pipe, or the write this signal interrupted: RuntimeError, reentrant call)
        pass
    _say(streams[1], f"{prog}: interrupted (SIGINT)")
    os._exit(130)


def _ignore_interrupts() -> None:
    """SIGINT ignored from now on: a second Ctrl-C (one pressed twice) while the first is said."""
    while True:
        try:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            return
        except KeyboardInterrupt:  # (the second came first)
            pass


def _say(stderr, line: str) -> None:
    try:
        print(line, file=stderr, flush=True)
    except (OSError, RuntimeError):  # (stderr is what failed; or the write the signal interrupted was stderr's)
        pass


def _to_devnull(stream) -> None:
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
    except (OSError, ValueError, AttributeError):  # (a stream without a descriptor: a test's)
        pass


def end(code: int) -> NoReturn:
    """Ends the process with `code` without Python's teardown (os._exit), after flushing the streams, logging,
    a `coverage run`'s data and jax.distributed. The teardown can abort a finished run (exit -6, "terminate called
    ... exception not rethrown": once in a CI run's ~100 trainer launches) or crash an interrupted one (exit -11,
    Ctrl-C during an XLA compilation): a native thread (XLA's, tensorstore's) that asks for the GIL while the
    interpreter finalizes is unwound by force."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            _to_devnull(stream)
    logging.shutdown()
    coverage = sys.modules.get("coverage")  # `coverage run` (README, Testing) saves at exit: save it here
    if coverage is not None and (measuring := coverage.Coverage.current()) is not None:
        measuring.stop()
        measuring.save()
    if "jax" in sys.modules:  # (--help loads no jax)
        import jax

        if jax.distributed.is_initialized():  # the coordinator's peers wait for its shutdown
            jax.distributed.shutdown()
    os._exit(code)
