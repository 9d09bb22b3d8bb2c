"""With the progress bar drawn (a terminal), a hook's run.log line and the SIGINT message each get a line of their
own: the bar (stderr) is cleared before the line (stdout) is written, not left in front of it on the terminal's line."""

from __future__ import annotations

import io
import os
import signal
import sys

import pytest

from diffjax.train import Hook, train


class LogsAndInterrupts(Hook):
    def on_step(self, run, step, metrics):
        if step == 2:
            run.log("hook: a line of its own")  # as README's BestEval hook logs
            os.kill(os.getpid(), signal.SIGINT)  # as ^C: the run saves this step and stops


def _line_before(text: str, index: int) -> str:
    return text[text.rfind("\n", 0, index) + 1 : index]


@pytest.mark.slow
def test_a_hooks_line_and_the_sigint_message_do_not_share_the_bars_line(tmp_path, monkeypatch):
    from test_trainer import _config

    terminal = io.StringIO()  # stdout and stderr, as one terminal shows them
    monkeypatch.setattr(sys, "stdout", terminal)
    monkeypatch.setattr(sys, "stderr", terminal)
    result = train(_config(tmp_path / "run", "train.steps=4", "train.progress=bar"), hooks=[LogsAndInterrupts()])
    out = terminal.getvalue()
    assert result.interrupted == "SIGINT", out
    for message in ("hook: a line of its own", "SIGINT: saved a checkpoint of step 2"):
        assert message in out, out
        before = _line_before(out, out.index(message))
        assert before == "" or before.endswith("\r"), repr(before)  # the bar cleared back to the line's start
    assert "it/s" in out or "step/s" in out, out  # the bar was drawn
