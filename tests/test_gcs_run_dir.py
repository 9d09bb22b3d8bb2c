"""gs:// run directories, on a GCS emulator on localhost (the `gcs` fixture): a run trains there, is killed, resumes
exactly, falls back past a damaged checkpoint, and its checkpoints load; the lock and the refusals on gs://."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import time

import jax
import numpy as np
import pytest

from diffjax import storage
from diffjax.checkpoint import load_model
from diffjax.run_dir import RunDir, RunDirInUseError, TrainerLock
from diffjax.train import train
from test_trainer import REPO_ROOT, _command, _config

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

RUN = ["train.steps=8", "checkpoint.every=2", "checkpoint.keep=2", "train.eval_every=0"]


def _committed_steps(run: RunDir) -> list[int]:
    return run.steps() if run.checkpoints.is_dir() else []


def _train_losses(metrics_file) -> dict[int, float]:
    records = [json.loads(line) for line in storage.as_path(metrics_file).read_text().splitlines()]
    steps = [r["step"] for r in records if r["kind"] == "train"]
    assert steps == sorted(set(steps)), f"a step logged twice or out of order: {steps}"
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


@pytest.mark.slow
@pytest.mark.both_legs
def test_a_run_on_gcs_is_killed_resumes_exactly_and_falls_back_past_a_damaged_checkpoint(gcs, tmp_path):
    url = gcs.url("run")
    run = RunDir(url)
    train(_config(tmp_path / "straight", *RUN), log=lambda _: None)  # the same run on a local disk

    # A trainer on gs:// killed (-9) once a checkpoint after the first is committed there.
    with open(tmp_path / "killed.log", "w") as output:
        process = subprocess.Popen(_command(url, *RUN), cwd=REPO_ROOT, stdout=output, stderr=subprocess.STDOUT)
    start = time.time()
    while not any(step >= 4 for step in _committed_steps(run)):
        assert process.poll() is None and time.time() - start < 300, (tmp_path / "killed.log").read_text()
        time.sleep(0.2)
    process.send_signal(signal.SIGKILL)
    process.wait()
    survivors = _committed_steps(run)
    assert survivors and survivors[-1] < 8, survivors

    lines = []
    resumed = train(_config(url, *RUN), log=lines.append)
    out = "\n".join(lines)
    assert f"note: took over {url}/trainer.lock, left by a trainer that is no longer running (pid {process.pid} " in out
    assert re.search(rf"^resumed from {url}/checkpoints/{survivors[-1]} \(step {survivors[-1]}\)$", out, flags=re.M), out
    assert resumed.step == 8 and not (run.path / "trainer.lock").exists()
    # Exactly the local run, step by step, though killed: every step's loss logged once (metrics.jsonl on gs://).
    assert _train_losses(run.metrics_file) == _train_losses(tmp_path / "straight" / "metrics.jsonl")
    assert run.steps() == [6, 8] and all((run.step_dir(s) / "digest.json").exists() for s in run.steps())
    assert [p.name for p in run.tensorboard.iterdir()][0].startswith("events.out.tfevents")
    assert (run.config_file.read_text() == (tmp_path / "straight" / "config.yaml").read_text()
            .replace(str(tmp_path / "straight"), url))

    # Its checkpoints load from gs:// (load_model: what generation, export and train.init_from read through).
    local, remote = load_model(tmp_path / "straight"), load_model(url)
    for x, y in zip(jax.tree.leaves(jax.tree.map(np.asarray, _params(local))), jax.tree.leaves(_params(remote))):
        np.testing.assert_array_equal(np.asarray(y), x)

    if importlib.util.find_spec("lm_eval"):  # the eval extra: lm-evaluation-harness reads gs:// runs too
        from diffjax.eval.lm_eval_adapter import load_for_eval

        evaluated, tokenizer = load_for_eval(url)
        assert tokenizer.name == "byte" and jax.tree.all(jax.tree.map(
            lambda x, y: bool((np.asarray(x) == np.asarray(y)).all()), _params(evaluated), _params(local)))

    # A damaged newest checkpoint: set aside on gs:// (copied, then deleted: no rename there), the run continues from
    # the one before.
    damaged_file = next(p for p in storage.files_under(run.step_dir(8) / "state") if "/d/" in os.fspath(p))
    damaged_file.write_bytes(b"not what was saved")
    lines = []
    train(_config(url, *RUN[1:], "train.steps=10", "train.profile_steps=[8,9]"), log=lines.append)
    out = "\n".join(lines)
    assert any(p.name.endswith(".xplane.pb") for p in storage.files_under(run.tensorboard / "plugins"))  # copied up
    assert f"warning: checkpoint {url}/checkpoints/8 is damaged (" in out, out
    assert f"moved it to {url}/damaged-checkpoints/8" in out and f"resumed from {url}/checkpoints/6 (step 6)" in out
    assert (run.damaged_checkpoints / "8" / "digest.json").exists() and run.steps() == [8, 10]


def _params(model):
    from flax import nnx

    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def test_the_lock_on_gcs_is_its_record(gcs):
    """No flock on an object store: a live holder on this host refuses a second trainer; another host's record
    cannot be checked, and is taken over with a note that says so; release removes only its own record."""
    path = storage.as_path(gcs.url("locked")) / "trainer.lock"
    alive = {"host": socket.gethostname(), "pid": os.getppid(), "started": "earlier"}
    path.write_text(json.dumps(alive))
    with pytest.raises(RunDirInUseError, match=rf"is in use by another trainer \(pid {os.getppid()} on "):
        TrainerLock.take(path)
    assert json.loads(path.read_text()) == alive  # untouched

    path.write_text(json.dumps({"host": "another-host", "pid": 1, "started": "earlier"}))
    lock = TrainerLock.take(path)
    assert json.loads(path.read_text())["pid"] == os.getpid()
    assert "from pid 1 on another-host (started earlier), which cannot be checked from here" in lock.describe_takeover()
    lock.release()
    assert not path.exists()


def test_a_conversion_into_gcs_is_refused_with_what_to_do(gcs):
    with pytest.raises(ValueError, match=r"gs://.*: a conversion writes to a local directory .* copy it to the bucket"):
        RunDir.for_conversion(gcs.url("converted"), overwrite=False)
