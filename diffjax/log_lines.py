"""How the command lines print log records: one line each on stderr, with one prefix.

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


def print_package_logs() -> None:
    """For a command line: every record (warnings and up) through _OnePrefix, in place of the handler absl's first
    log (importing Orbax logs) put on the root logger with Python's default format. A handler set up otherwise
    (a host program's, pytest's) is kept, and then nothing is added."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if type(handler) is logging.StreamHandler and getattr(handler.formatter, "_fmt", None) == logging.BASIC_FORMAT:
            root.removeHandler(handler)
    logging.basicConfig(level=logging.WARNING, format="%(message)s", handlers=[_OnePrefix()])
