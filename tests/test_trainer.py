"""The trainer end to end: exact resume, kill -9 and SIGTERM, metrics, and the default run learning.

Runs use a very small model on a slice of the built-in corpus so each takes seconds.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from diffjax.run_dir import RunDirInUseError
from diffjax.train import Hook, load_run_config, train
from diffjax.train.state_checkpoints import Checkpointer
from diffjax.train.config import CheckpointConfig

REPO_ROOT = Path(__file__).resolve().parents[1]
SMALL = [
    "model.d_model=32", "model.num_layers=2", "model.num_heads=2", "model.max_seq_len=64",
    "data.seq_len=32", "data.builtin_bytes=200000", "data.eval_batches=2", "data.eval_fraction=0.2",
    "data.shuffle_window_tokens=4096",  # the default window packs the corpus 5 times over before the first batch
    "train.batch_size=4", "train.log_every=1", "train.eval_every=0", "train.sample_tokens=8",
    "train.progress=lines", "optim.warmup_steps=2", "parallel.data=1",  # one of conftest's 8 devices
]


def _config(run_dir, *overrides):
    return load_run_config(REPO_ROOT / "configs" / "tiny.yaml", SMALL + [f"train.run_dir={run_dir}", *overrides])


@pytest.mark.slow
def test_extending_a_finished_run_says_how_its_learning_rate_changes(tmp_path):
    """train.steps raised on a finished run re-plans the schedule: the note names the rate the next step trains at,
    which is the rate metrics.jsonl records for it."""
    schedule = ["optim.warmup_steps=1", "optim.decay=linear", "optim.min_lr=1e-4", "optim.lr=1e-3"]
    train(_config(tmp_path / "run", "train.steps=2", *schedule), log=lambda _: None)
    lines = []
    train(_config(tmp_path / "run", "train.steps=4", *schedule), log=lines.append)
    note = next(line for line in lines if "schedule changes" in line)
    rate = float(re.search(r"step 3 trains at lr (\S+) \(the run's schedule: 1\.00e-04\)", note).group(1))
    assert "decay reaches min_lr 1.0e-04 at step 4 (was 2); optim.decay_steps=2 keeps the run's schedule" in note
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rate == pytest.approx(next(r["lr"] for r in records if r["step"] == 3 and r["kind"] == "train"), rel=5e-3)


def test_resume_is_exact(tmp_path):
    """2N steps straight == N steps, stop, resume for N more: same losses and bit-identical state."""
    n = 4
    # The lr schedule must not depend on where we stop; the lambda warm-up (stopped inside it) and a per-parameter
    # learning rate must resume as they were.
    schedule = ["optim.decay_steps=8", "optim.lambda_warmup_steps=6", "optim.lr_multipliers=[lambda_=2]"]
    # The straight run saves every step asynchronously while later steps (which donate the state's
    # buffers) go on: its step-n checkpoint must still equal the stopped run's final one.
    straight = train(_config(tmp_path / "straight", f"train.steps={2 * n}", *schedule, "checkpoint.every=1",
                             "checkpoint.keep=10"), log=lambda _: None)
    first = train(_config(tmp_path / "resumed", f"train.steps={n}", *schedule, "checkpoint.every=100"), log=lambda _: None)
    lines = []
    second = train(_config(tmp_path / "resumed", f"train.steps={2 * n}", *schedule, "checkpoint.every=100"), log=lines.append)
    assert any(f"(step {n})" in line and line.startswith("resumed from") for line in lines), lines
    assert not any("schedule changes" in line for line in lines), lines  # optim.decay_steps fixed it
    assert sorted(first.losses) == list(range(1, n + 1)) and sorted(second.losses) == list(range(n + 1, 2 * n + 1))
    resumed_losses = {**first.losses, **second.losses}
    assert resumed_losses == straight.losses  # exact float equality, step by step
    assert second.eval_losses[2 * n] == straight.eval_losses[2 * n]
    assert second.sample == straight.sample

    for run in ("straight", "resumed"):
        assert Checkpointer(tmp_path / run, CheckpointConfig()).latest_step() == 2 * n
    mid_straight = Checkpointer(tmp_path / "straight", CheckpointConfig()).read(n)
    mid_resumed = Checkpointer(tmp_path / "resumed", CheckpointConfig()).read(n)
    for x, y in zip(jax.tree.leaves(mid_straight["state"]), jax.tree.leaves(mid_resumed["state"])):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    a = Checkpointer(tmp_path / "straight", CheckpointConfig()).read(2 * n)
    b = Checkpointer(tmp_path / "resumed", CheckpointConfig()).read(2 * n)
    leaves_a, leaves_b = jax.tree.leaves(a["state"]), jax.tree.leaves(b["state"])
    assert len(leaves_a) == len(leaves_b) > 10
    for x, y in zip(leaves_a, leaves_b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert a["data"] == b["data"]  # the data iterator stands at the same place


def _read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


class Recorder(Hook):
    """A user's hook: what it was called with and, at each checkpoint, what was on disk then."""

    def __init__(self):
        self.calls, self.step_losses, self.eval_losses = [], {}, {}

    def on_start(self, run):
        self.calls.append(("start", run.step))

    def on_step(self, run, step, metrics):
        self.step_losses[step] = metrics["loss"]  # a device array: read at the end, not per step

    def on_eval(self, run, step, loss):
        self.eval_losses[step] = loss

    def on_checkpoint(self, run, step):
        written = [r["step"] for r in _read_metrics(run.run_dir) if r["kind"] == "train"]
        self.calls.append(("checkpoint", step, written[-1], (run.checkpointer.directory / str(step)).exists()))

    def on_end(self, run, result):
        self.calls.append(("end", result.step))


@pytest.mark.slow
def test_metrics_are_written_as_jsonl_and_tensorboard_and_a_user_hook_sees_every_step(tmp_path):
    recorder = Recorder()
    lines = []
    result = train(_config(tmp_path / "run", "train.steps=3", "train.eval_every=2", "train.peak_tflops_per_device=1",
                           "checkpoint.every=2", "train.profile_steps=[2,3]"), log=lines.append, hooks=[recorder])
    records = _read_metrics(tmp_path / "run")
    train_records = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train_records] == [1, 2, 3]
    for record in train_records[1:]:  # the first step compiles: no rate yet
        for key in ("loss", "lr", "grad_norm", "tokens_per_second", "tflops_per_device", "mfu", "lambda/layer_0", "lambda/layer_1"):
            assert key in record and math.isfinite(record[key]), (key, record)
    assert train_records[0]["lr"] == 0.0 and train_records[1]["lr"] > 0  # warmup from 0
    # lambda starts near lambda_init = 0.8 - 0.6 exp(-0.3 depth)
    assert abs(train_records[-1]["lambda/layer_1"] - (0.8 - 0.6 * math.exp(-0.3))) < 0.2
    assert [r["step"] for r in records if r["kind"] == "eval"] == [2, 3]
    assert result.losses[3] == train_records[-1]["loss"]
    events = list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    # train.profile_steps: one jax.profiler trace of steps 2-3 beside the events, for TensorBoard's profile tab.
    traces = list((tmp_path / "run" / "tensorboard" / "plugins" / "profile").glob("*/*.xplane.pb"))
    assert len(traces) == 1 and b"train_step" in traces[0].read_bytes(), traces
    assert any(line.startswith("profile of steps 2-3 written under") for line in lines), lines

    assert {step: float(loss) for step, loss in recorder.step_losses.items()} == result.losses
    assert recorder.eval_losses == result.eval_losses == {r["step"]: r["loss"] for r in records if r["kind"] == "eval"}
    # Each checkpoint's steps are in metrics.jsonl before its save starts.
    assert recorder.calls == [("start", 0), ("checkpoint", 2, 2, False), ("checkpoint", 3, 3, False), ("end", 3)]


def _command(run_dir: Path, *overrides) -> list[str]:
    return [sys.executable, "train.py", *SMALL, f"train.run_dir={run_dir}", *overrides]


def _wait_for(predicate, process, timeout=300.0):
    start = time.time()
    while not predicate():
        if process.poll() is not None:
            raise AssertionError(f"training exited early with {process.returncode}: {process.stdout.read()}")
        if time.time() - start > timeout:
            process.kill()
            raise AssertionError("timed out waiting for training progress")
        time.sleep(0.2)


def _checkpoint_steps(run_dir: Path) -> list[int]:
    directory = run_dir / "checkpoints"
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit()) if directory.exists() else []


@pytest.mark.slow
@pytest.mark.both_legs
def test_kill_9_then_rerun_continues_from_the_last_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    # Metrics are flushed to the log only every 100 steps: the records must still survive the kill.
    command = _command(run_dir, "train.steps=30", "checkpoint.every=3", "checkpoint.keep=2", "train.log_every=100")
    process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _wait_for(lambda: len(_checkpoint_steps(run_dir)) >= 2 and _checkpoint_steps(run_dir)[-1] >= 9, process)
    # A second trainer on the same directory (here with another lr) is refused, and changes nothing there.
    with pytest.raises(RunDirInUseError, match=rf"train.run_dir {run_dir} is in use by another trainer \(pid {process.pid} "):
        train(_config(run_dir, "train.steps=30", "optim.lr=1e-2"), log=lambda _: None)
    process.send_signal(signal.SIGKILL)
    process.wait()
    survivors = _checkpoint_steps(run_dir)
    assert survivors and all(step % 3 == 0 for step in survivors)

    rerun = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert f"note: took over {run_dir / 'trainer.lock'}, left by a trainer that is no longer running (pid {process.pid} " in rerun.stdout
    assert not (run_dir / "trainer.lock").exists()  # released at the end
    resumed = re.search(r"^resumed from .* \(step (\d+)\)$", rerun.stdout, flags=re.M)
    assert resumed, rerun.stdout
    # It restored the newest complete checkpoint (an interrupted save is never chosen).
    assert int(resumed.group(1)) in survivors and int(resumed.group(1)) >= max(survivors) - 3
    records = [r for r in _read_metrics(run_dir) if r["kind"] == "train"]
    assert [r["step"] for r in records] == list(range(1, 31))  # every step exactly once, none lost or doubled
    assert _checkpoint_steps(run_dir)[-1] == 30


@pytest.mark.slow
@pytest.mark.both_legs
def test_sigterm_saves_the_current_step(tmp_path):
    run_dir = tmp_path / "run"
    command = _command(run_dir, "train.steps=500", "checkpoint.every=1000")
    process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = run_dir / "metrics.jsonl"
    _wait_for(lambda: metrics.exists() and metrics.read_text().count('"train"') >= 3, process)
    process.send_signal(signal.SIGTERM)
    out, _ = process.communicate(timeout=300)
    assert process.returncode == 128 + signal.SIGTERM, out
    saved = re.search(r"^SIGTERM: saved a checkpoint of step (\d+)", out, flags=re.M)
    assert saved, out
    step = int(saved.group(1))
    assert 3 <= step < 500 and _checkpoint_steps(run_dir) == [step]  # every=1000: only the SIGTERM save


@pytest.mark.slow
def test_a_run_directory_refuses_a_different_model(tmp_path):
    train(_config(tmp_path / "run", "train.steps=1"), log=lambda _: None)
    with pytest.raises(ValueError, match=r"different model \(model\.num_layers differ"):
        train(_config(tmp_path / "run", "train.steps=2", "model.num_layers=3"), log=lambda _: None)
    (tmp_path / "run" / "config.yaml").unlink()  # then the checkpoint itself tells
    with pytest.raises(ValueError, match=r"checkpoints/1 holds a different model than this run's .*: blocks\.attn\.k_kernel has shape \(2, .*, expected \(3, .*; and 11 more$"):
        train(_config(tmp_path / "run", "train.steps=2", "model.num_layers=3"), log=lambda _: None)


@pytest.mark.single_leg  # the newest leg trains through train() in every other trainer test; this one is the slow full-size default
@pytest.mark.slow
def test_default_run_learns(tmp_path):
    """`python train.py` with the default config, shortened: the loss falls well below uniform."""
    one_cpu = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # as on a user's CPU: one device
    result = subprocess.run(
        [sys.executable, "train.py", "train.steps=30", "train.eval_every=15", f"train.run_dir={tmp_path / 'run'}",
         "train.progress=lines", "train.sample_tokens=40"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, env=one_cpu,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    progress = re.findall(r"^step\s+(\d+)/30 \| loss ([\d.]+) \|", out, flags=re.M)
    assert {1, 15, 25, 30} <= {int(s) for s, _ in progress}, out  # every log_every = 25 steps, and at an eval
    first, last = float(progress[0][1]), float(progress[-1][1])
    assert abs(first - math.log(257)) < 0.2, out  # starts near uniform over the byte vocabulary
    assert last < first - 1.5, out
    evals = re.findall(r"eval loss ([\d.]+)", out)
    assert len(evals) == 2 and float(evals[-1]) < first - 1.5, out
    assert "sample (temperature" in out and "tok/s" in out and "eta" in out


@pytest.mark.slow
def test_init_from_takes_the_params_of_another_run(tmp_path):
    """The 64K-extension path: a fresh run (other RoPE theta) starts from another run's params."""
    train(_config(tmp_path / "base", "train.steps=2"), log=lambda _: None)
    lines = []
    train(_config(tmp_path / "long", "train.steps=1", "model.rope_theta=640000", "optim.warmup_steps=0",
                  "optim.lr=1e-12", "optim.min_lr=0", "optim.weight_decay=0", f"train.init_from={tmp_path / 'base'}"),
          log=lines.append)
    assert any(line.startswith("initialized the params from") for line in lines)
    base = Checkpointer(tmp_path / "base", CheckpointConfig()).read(2)["state"]["params"]
    long = Checkpointer(tmp_path / "long", CheckpointConfig()).read(1)["state"]["params"]
    for x, y in zip(jax.tree.leaves(base), jax.tree.leaves(long)):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=1e-9)
    with pytest.raises(ValueError, match="init_from.*does not match"):
        train(_config(tmp_path / "other", "train.steps=1", "model.num_layers=3", f"train.init_from={tmp_path / 'base'}"),
              log=lambda _: None)
    with pytest.raises(FileNotFoundError, match="init_from"):
        train(_config(tmp_path / "none", "train.steps=1", f"train.init_from={tmp_path / 'missing'}"), log=lambda _: None)


@pytest.mark.slow
@pytest.mark.both_legs
def test_params_only_checkpoint_loads_trains_on_and_initializes(tmp_path):
    """save_params (what the converter writes): load_model gives the same logits, train.py in that
    run directory trains on from those params, and train.init_from takes them."""
    from flax import nnx

    from diffjax.model import TransformerLM
    from diffjax.checkpoint import load_model, save_params

    config = _config(tmp_path / "converted", "train.steps=1", "optim.lr=1e-12", "optim.min_lr=0",
                     "optim.warmup_steps=0", "optim.weight_decay=0")
    model = TransformerLM(config.model, rngs=nnx.Rngs(7))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    save_params(tmp_path / "converted", params, config.model)
    with pytest.raises(FileExistsError, match="already holds checkpoints"):
        save_params(tmp_path / "converted", params, config.model)
    tokens = np.arange(12, dtype=np.int32)[None] % config.model.vocab_size
    np.testing.assert_array_equal(np.asarray(load_model(tmp_path / "converted")(tokens)), np.asarray(model(tokens)))

    lines = []
    result = train(config, log=lines.append)
    assert result.step == 1 and any("params-only checkpoint" in line for line in lines), lines
    # The converter's config.yaml names the model and a few keys: the others are not "changed".
    changed = [line for line in lines if line.startswith("note: resuming with changed")]
    assert not changed or "optim.b1" not in changed[0], changed
    trained = Checkpointer(tmp_path / "converted", CheckpointConfig()).read(1)["state"]["params"]
    for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(trained)):  # lr 1e-12: the same params
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=1e-9)
    with pytest.raises(ValueError, match="does not match"):
        load_model_config = _config(tmp_path / "other", "train.steps=1", "model.num_layers=3",
                                    f"train.init_from={tmp_path / 'converted' / 'checkpoints' / '0'}")
        train(load_model_config, log=lambda _: None)


@pytest.mark.single_leg  # the data path and the loss are the same on every JAX version
def test_segments_data_trains_only_on_the_labelled_tokens(tmp_path):
    """jsonl "segments" documents: the loss (train and eval) counts the labelled segments' tokens alone. Each
    document is 30 unlabelled bytes, one labelled byte and the eos (labelled with it): one 32-token row, whose
    targets are that byte and the eos, 2 per row, where a text document would count 31."""
    data = tmp_path / "sft.jsonl"
    rng = np.random.default_rng(0)
    with open(data, "w") as file:
        for _ in range(64):
            prompt = "".join(rng.choice(list("abcdefgh"), 30))
            file.write(json.dumps({"segments": [{"text": prompt, "label": False}, {"text": prompt[0], "label": True}]}) + "\n")

    class TokensCounted(Hook):
        def __init__(self):
            self.counts = []

        def on_step(self, run, step, metrics):
            self.counts.append(metrics["loss_tokens"])

    counted = TokensCounted()
    result = train(_config(tmp_path / "run", "data.source=jsonl", f"data.paths={data}", "data.shuffle_window_tokens=32",
                           "train.steps=3", "train.eval_every=3"), log=lambda _: None, hooks=[counted])
    assert [float(count) for count in counted.counts] == [4 * 2] * 3  # batch 4 rows x 2 targets
    assert math.isfinite(result.eval_losses[3])
