"""How the command lines keep stderr to one line per thing said: log records with one prefix, and no tracebacks
from the writes a failed checkpoint save left in flight.

The messages are lines for a person, most already starting "warning: "; printed through the root logger they were
prefixed again ("WARNING:diffjax.checkpoint:warning: ..." once absl, the first time Orbax logs, has installed
Python's default handler; "WARNING: warning: ..." under the converter's format)."""

from __future__ import annotations

import logging
import sys


class _OnePrefix(logging.Handler):
    """A record as "<level>: <message>", the level not repeated when the message starts with it; written to the
    sys.stderr of the moment (tests swap it)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line, prefix = self.format(record), f"{record.levelname.lower()}: "
            print(line if line.startswith(prefix) else prefix + line, file=sys.stderr)
        except Exception:
            self.handleError(record)


class _DropLateWriteCallbacks:
    """sys.unraisablehook, passing on all but one kind: when a checkpoint write fails (a full disk), Orbax's event
    loop closes while tensorstore's other writes are in flight, and each of their completion callbacks then fails in
    `call_soon_threadsafe` with "Event loop is closed", printed as a traceback (36 of them on the first save of a
    tiny model). The failure itself reaches the caller, which says it in one line."""

    def __init__(self, previous):
        self.previous = previous

    def __call__(self, unraisable) -> None:
        outermost = unraisable.exc_traceback
        if not (unraisable.exc_type is RuntimeError and str(unraisable.exc_value) == "Event loop is closed"
                and outermost is not None and outermost.tb_frame.f_code.co_name == "call_soon_threadsafe"):
            self.previous(unraisable)


def drop_late_write_callbacks() -> None:
    """Installs _DropLateWriteCallbacks for the process's life (the callbacks may come after the writer closed)."""
    if not isinstance(sys.unraisablehook, _DropLateWriteCallbacks):
        sys.unraisablehook = _DropLateWriteCallbacks(sys.unraisablehook)


def print_package_logs() -> None:
    """For a command line: every record (warnings and up) through _OnePrefix, in place of the handler absl's first
    log (importing Orbax logs) put on the root logger with Python's default format. A handler set up otherwise
    (a host program's, pytest's) is kept, and then nothing is added."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if type(handler) is logging.StreamHandler and getattr(handler.formatter, "_fmt", None) == logging.BASIC_FORMAT:
            root.removeHandler(handler)
    logging.basicConfig(level=logging.WARNING, format="%(message)s", handlers=[_OnePrefix()])
    drop_late_write_callbacks()
