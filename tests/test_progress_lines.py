"""With the progress bar drawn (a terminal), a hook's run.log line and the SIGINT message each get a line of their
own: the bar (stderr) is cleared before the line (stdout) is written, not left in front of it on the terminal's line."""

from __future__ import annotations

import io
import os
import re
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


def test_the_mtp_depths_losses_stand_beside_the_main_loss(monkeypatch):
    """Issue 62 item 8: the depths' losses were in metrics.jsonl only; the line and the bar show them after the
    main loss, depth 1 first."""
    from diffjax.config import ModelConfig
    from diffjax.model.facets import model_facets
    from diffjax.train.progress import Progress

    facets = model_facets(ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=2, mtp_depths=2))
    shown = lambda values: {k: v for facet in facets for k, v in facet.shown(values).items()}  # as hooks.py gives it
    lines = []
    values = {"loss": 2.5, "grad_norm": 1.0, "lr": 1e-3, "mtp_loss/depth_2": 3.25, "mtp_loss/depth_1": 2.75}
    Progress("lines", 0, 100, 2048, lines.append, shown).update(10, values)
    assert lines == ["step  10/100 | loss 2.5000 | mtp 2.7500 3.2500 | grad norm 1.000 | lr 1.00e-03"]
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    bar = Progress("bar", 0, 100, 2048, lines.append, shown)
    bar.update(10, values)
    assert bar.bar.postfix == "loss=2.5000, mtp=2.7500 3.2500"
    bar.close()


@pytest.mark.slow
def test_a_run_with_mtp_depths_shows_their_losses_in_its_lines_and_tensorboard(tmp_path):
    """What the trainer's step names its metrics reaches the line: each depth's loss, every logged step."""
    from tensorboardX.proto import event_pb2

    from test_trainer import _config

    lines = []
    train(_config(tmp_path / "run", "train.steps=2", "model.mtp_depths=2", "train.sample_tokens=0"), log=lines.append)
    steps = [line for line in lines if re.match(r"step \d+/", line)]
    assert len(steps) == 2 and all(re.search(r"\| loss [\d.]+ \| mtp [\d.]+ [\d.]+ \| grad norm", s) for s in steps), lines
    tags = set()
    for events in (tmp_path / "run" / "tensorboard").iterdir():
        data = events.read_bytes()
        while data:  # TFRecords: length, its CRC, the event, its CRC
            length = int.from_bytes(data[:8], "little")
            tags |= {value.tag for value in event_pb2.Event.FromString(data[12:12 + length]).summary.value}
            data = data[12 + length + 4:]
    assert {"train/loss", "train/mtp_loss/depth_1", "train/mtp_loss/depth_2"} <= tags
