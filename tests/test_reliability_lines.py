"""Issue 45, items 2-6: what goes wrong is one line on stderr, run as users run the command lines, and nothing
saved is lost. A full disk is a small tmpfs (root only; those tests skip elsewhere) or, in process, a file that
raises ENOSPC."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
from flax import nnx

from diffjax.config import ModelConfig
from diffjax.model import TransformerLM

REPO_ROOT = Path(__file__).resolve().parents[1]
TRAIN = [  # test_trainer.SMALL: a tiny model on the built-in corpus, one of conftest's 8 devices
    "model.d_model=32", "model.num_layers=2", "model.num_heads=2", "model.max_seq_len=64", "data.seq_len=32",
    "data.builtin_bytes=200000", "data.eval_batches=2", "data.eval_fraction=0.2", "data.shuffle_window_tokens=4096",
    "train.batch_size=4", "train.eval_every=0", "train.sample_tokens=0", "train.progress=lines",
    "optim.warmup_steps=2", "parallel.data=1",
]


def _run(*command, timeout=300):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, *map(str, command)], capture_output=True, text=True, cwd=REPO_ROOT,
                          env=env, timeout=timeout)


def _lines(stderr: str) -> list[str]:
    return [line for line in stderr.strip().splitlines() if "uses 1 of the 8 devices" not in line]  # conftest's 8


@pytest.fixture
def small_disk(tmp_path):
    """small_disk(kib): a tmpfs of that size, unmounted after the test."""
    mounted = []

    def mount(kib: int) -> Path:
        disk = tmp_path / f"disk{len(mounted)}"
        disk.mkdir()
        if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(disk)],
                          capture_output=True).returncode:
            pytest.skip("cannot mount a small tmpfs here (not root)")
        mounted.append(disk)
        return disk

    yield mount
    for disk in mounted:
        subprocess.run(["umount", str(disk)], check=True)


# --- 2. the first save of a run on a full disk ------------------------------------------------------------------

@pytest.mark.slow
def test_the_first_save_on_a_full_disk_is_one_line(small_disk):
    """No earlier checkpoint, so the free-space check cannot refuse: Orbax starts writing and fails. Before, 217
    lines: tensorstore's callbacks of the writes in flight met Orbax's closed event loop, one traceback each."""
    run_dir = small_disk(200) / "run"
    result = _run("train.py", *TRAIN, f"train.run_dir={run_dir}", "train.steps=4", "checkpoint.every=2")
    assert result.returncode == 1, result.stderr
    lines = _lines(result.stderr)
    assert len(lines) == 1, f"{len(lines)} lines:\n{result.stderr[-3000:]}"
    assert re.fullmatch(rf"error: saving the checkpoint of step 2 in {run_dir / 'checkpoints'} failed: .*No space left "
                        r"on device.*; no checkpoint had been saved before", lines[0]), lines[0]
    assert list((run_dir / "checkpoints").iterdir()) == []  # the temporary directory went too


def test_only_the_closed_loop_callbacks_of_a_failed_save_are_dropped(tmp_path, capsys):
    """The unraisable tensorstore reports (its C code calls call_soon_threadsafe on Orbax's closed loop); any other
    unraisable error still reaches the hook that was there before."""
    import asyncio

    from diffjax.train.config import CheckpointConfig
    from diffjax.train.state_checkpoints import Checkpointer

    seen = []
    previous, sys.unraisablehook = sys.unraisablehook, seen.append
    try:
        Checkpointer(tmp_path / "run", CheckpointConfig()).close()
        loop = asyncio.new_event_loop()
        loop.close()
        try:
            loop.call_soon_threadsafe(print)
        except RuntimeError as error:  # its traceback from call_soon_threadsafe on, as tensorstore's C code has it
            late_callback = types.SimpleNamespace(exc_type=RuntimeError, exc_value=error, object=None, err_msg=None,
                                                  exc_traceback=error.__traceback__.tb_next)
        other = ValueError("Event loop is closed")
        other_report = types.SimpleNamespace(exc_type=ValueError, exc_value=other, exc_traceback=None, object=None,
                                             err_msg=None)
        sys.unraisablehook(late_callback)
        sys.unraisablehook(other_report)
    finally:
        sys.unraisablehook = previous
    assert seen == [other_report]


def test_only_the_unretrieved_failures_of_orbax_writes_are_dropped(tmp_path, caplog):
    """The sibling writes Orbax's gather leaves behind: a real Orbax write coroutine that fails in a task nobody
    awaits, or a future that failed on a file of a save in progress (tensorstore's, no Python frames), is not logged
    once the checkpointer is set up; anyone else's failure is. (Before, the slow full-disk tests printed 7 to 29
    lines on some runs, 1 on others.)"""
    import asyncio
    import gc

    import numpy as np
    import tensorstore as ts
    from orbax.checkpoint._src.serialization import type_handlers

    from diffjax.run_dir import TEMPORARY_MARK
    from diffjax.train.config import CheckpointConfig
    from diffjax.train.state_checkpoints import Checkpointer

    async def fails(message):
        raise ValueError(message)

    def failed_future(message):
        future = asyncio.get_running_loop().create_future()
        future.set_exception(ValueError(message))

    def orphan(start):
        async def leave_behind():
            task = start()
            await asyncio.sleep(0.05)  # it fails meanwhile, and is never awaited
            del task
        asyncio.run(leave_behind())
        gc.collect()

    Checkpointer(tmp_path / "run", CheckpointConfig()).close()
    with caplog.at_level("ERROR", logger="asyncio"):
        orphan(lambda: asyncio.ensure_future(type_handlers.NumpyHandler()._open_and_write(
            np.zeros(3), {"driver": "no_such_driver"}, ts.Context())))
        orphan(lambda: failed_future(f"Failed writing: /run/checkpoints/2{TEMPORARY_MARK}/d/1: No space left"))
        orphan(lambda: asyncio.ensure_future(fails("a failure outside Orbax")))
        orphan(lambda: failed_future("Failed writing: /elsewhere/d/1: No space left"))
    unretrieved = [r for r in caplog.records if "exception was never retrieved" in r.getMessage()]
    assert [str(r.exc_info[1]) for r in unretrieved] == ["a failure outside Orbax",
                                                         "Failed writing: /elsewhere/d/1: No space left"]


def test_after_a_failed_write_its_unstarted_coroutines_are_not_warned_about():
    import gc
    import warnings

    from diffjax.log_lines import after_a_failed_write

    async def write():
        pass

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        write()  # never awaited
        gc.collect()
        after_a_failed_write()
        write()
        gc.collect()
    assert [str(w.message) for w in seen] == [
        "coroutine 'test_after_a_failed_write_its_unstarted_coroutines_are_not_warned_about.<locals>.write' was never "
        "awaited"]


@pytest.mark.slow
def test_a_conversion_onto_a_full_disk_is_one_line(tiny_dirs, small_disk):
    """The converter's Orbax save fails the same way (before: ~180 lines, Orbax's logged tracebacks too)."""
    disk = small_disk(60)
    result = _run("-m", "diffjax.convert", "hf-to-diffjax", tiny_dirs / "hf", disk / "out")
    lines = [line for line in result.stderr.splitlines() if not line.startswith("  [")]  # the progress lines
    assert result.returncode == 1 and len(lines) == 1, result.stderr[-3000:]  # 1: a write failed, the input is fine
    assert lines[0].startswith("error: ") and lines[0].endswith("No space left on device; nothing of it was kept"), \
        lines[0]


# --- 6. a full disk under the metrics ---------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("tensorboard", [True, False])
def test_a_full_disk_under_the_metrics_is_one_line(small_disk, tensorboard):
    """40 KiB fill up with metrics.jsonl and TensorBoard events long before the only save (step 300). Before:
    tensorboardX's writer thread printed its traceback and died, and the run then hung on its full queue (even
    SIGTERM); without TensorBoard, metrics.jsonl's write was a traceback."""
    run_dir = small_disk(40) / "run"
    command = ["train.py", *TRAIN, f"train.run_dir={run_dir}", "train.steps=300", "checkpoint.every=1000",
               "train.log_every=50", f"train.tensorboard={str(tensorboard).lower()}"]
    try:
        result = _run(*command, timeout=150)
    except subprocess.TimeoutExpired:
        pytest.fail("the run hung on the full disk")
    lines = _lines(result.stderr)
    assert result.returncode == 1 and len(lines) == 1, result.stderr[-3000:]
    files = f"({re.escape(str(run_dir / 'metrics.jsonl'))}|{re.escape(str(run_dir / 'tensorboard'))})"
    assert re.fullmatch(rf"error: could not write the metrics (of|by) step \d+ to {files} \(No space left on device\); "
                        r"the checkpoints saved so far are intact: free some space and rerun to resume", lines[0]), \
        lines[0]


@pytest.mark.slow
def test_tensorboards_writer_thread_hands_its_full_disk_to_the_training_thread(tmp_path, monkeypatch):
    """In process, without root: the event file fails as a full disk does. Every later step is still accepted at
    once (the thread keeps emptying its queue) and the first write after the failure raises the one error."""
    from diffjax.run_dir import RunDir
    from diffjax.train.metrics import MetricsWriteError, MetricsWriter

    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    writer = MetricsWriter(run, tensorboard=True)

    class Full:
        closed = False

        def write(self, data=None):
            raise OSError(errno.ENOSPC, "No space left on device")

        flush = write

        def close(self):
            self.closed = True

    writer._events.file = Full()
    with pytest.raises(MetricsWriteError, match=rf"by step \d+ to {re.escape(str(run.tensorboard))} \(No space left"):
        for step in range(1, 200):
            writer.write(step, "train", {"loss": 1.0, "lr": 0.1})
            writer._tensorboard.flush()  # (the thread flushes every 120 s)
    writer.close()  # reported once: closing says nothing more
    assert json.loads(run.metrics_file.read_text().splitlines()[0])["step"] == 1  # metrics.jsonl went on


# --- 3. a conversion never writes into its source ---------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    """A params-only run directory with checkpoints 0 and 1 (1 damaged) and its HF export."""
    from diffjax.convert.hf_directories import diffjax_to_hf
    from diffjax.params_checkpoint import save_params

    root = tmp_path_factory.mktemp("reliability")
    config = ModelConfig(vocab_size=257, d_model=32, num_layers=1, num_heads=2, max_seq_len=32)
    params = nnx.to_pure_dict(nnx.state(TransformerLM(config, rngs=nnx.Rngs(0)), nnx.Param))
    save_params(root / "run", params, config)
    (root / "run" / "config.yaml").write_text((root / "run" / "config.yaml").read_text().replace(
        "data:\n", "data:\n  tokenizer: {kind: byte}\n"))
    diffjax_to_hf(root / "run", root / "hf")
    save_params(root / "later", params, config, step=1)
    damaged = shutil.move(root / "later" / "checkpoints" / "1", root / "run" / "checkpoints" / "1")
    victim = max((p for p in Path(damaged).rglob("*") if p.is_file() and p.name != "digest.json"),
                 key=lambda p: p.stat().st_size)
    victim.write_bytes(victim.read_bytes()[:-1] + bytes([victim.read_bytes()[-1] ^ 1]))
    return root


def _listing(directory: Path) -> dict[str, int]:
    return {str(p.relative_to(directory)): p.stat().st_size for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_a_conversion_into_its_own_source_is_refused_before_writing(tiny_dirs, tmp_path):
    run, hf = tiny_dirs / "run", tiny_dirs / "hf"
    (tmp_path / "hf_link").symlink_to(hf)
    before = {path: _listing(path) for path in (run, hf)}
    cases = [
        ("diffjax-to-hf", run, run, rf"DST {run} is SRC {run}"),
        ("hf-to-diffjax", hf, tmp_path / "hf_link", rf"DST {tmp_path / 'hf_link'} is SRC {hf} \(links resolved: "),
        ("upcycle", hf, hf / "dst", rf"DST {hf / 'dst'} is inside SRC {hf}"),
        ("diffjax-to-hf", run / "checkpoints" / "0", run, rf"DST {run} holds SRC {run / 'checkpoints' / '0'}"),
    ]
    for command, src, dst, message in cases:
        result = _run("-m", "diffjax.convert", command, src, dst, "--overwrite")
        assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert re.fullmatch(f"error: {message}.*: a conversion does not write where it reads; choose a DST outside "
                            "SRC", result.stderr.strip()), result.stderr
    assert {path: _listing(path) for path in (run, hf)} == before and not (hf / "dst").exists()


def test_merging_a_lora_run_into_its_base_is_refused(tmp_path):
    from diffjax.convert.common import ConversionError, refuse_overlap

    base = tmp_path / "base"
    base.mkdir()
    with pytest.raises(ConversionError, match=rf"DST {base} is the LoRA run's base \(train.init_from\) {base}"):
        refuse_overlap(base, base, source_name="the LoRA run's base (train.init_from)")
    refuse_overlap(base, tmp_path / "base2")  # a sibling with a common prefix is apart


# --- 4. one prefix per line; the pickle refusal in our words ----------------------------------------------------

@pytest.mark.slow
def test_a_skipped_damaged_checkpoint_is_one_warning_line_with_one_prefix(tiny_dirs, tmp_path):
    run = tiny_dirs / "run"
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    analysis = _run("-m", "diffjax.analysis.outliers", "--checkpoint", run, "--text", text, "--tokens", "64",
                    "--seq-len", "16")
    export = _run("-m", "diffjax.convert", "diffjax-to-hf", run, tmp_path / "hf")
    for result in (analysis, export):
        assert result.returncode == 0, result.stderr
        warnings = [line for line in result.stderr.splitlines() if "warning" in line.lower()]
        assert len(warnings) == 1 and warnings[0].startswith("warning: ") and warnings[0].lower().count("warning") == 1
        assert "skipped the damaged checkpoint(s) 1 " in warnings[0] and str(run / "checkpoints" / "0") in warnings[0]


@pytest.mark.slow
def test_a_pickle_with_code_is_refused_in_one_line(tiny_dirs, tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.numpy import load_file

    source = tmp_path / "hf"
    source.mkdir()
    shutil.copy(tiny_dirs / "hf" / "config.json", source)
    arrays = load_file(tiny_dirs / "hf" / "model.safetensors")
    tensors = {name: torch.from_numpy(array) for name, array in arrays.items()}
    torch.save({**tensors, "payload": _RunsCode()}, source / "pytorch_model.bin")
    result = _run("-m", "diffjax.convert", "hf-to-diffjax", source, tmp_path / "out")
    assert result.returncode == 2 and result.stderr == (
        f"error: {source / 'pytorch_model.bin'}: refused to load: the file holds Python objects other than tensors, "
        "and unpickling them could run code; convert a safetensors version of the checkpoint, or, only if you trust "
        "its source, load it in torch and save its tensors alone\n"), result.stderr
    assert not (tmp_path / "out" / "checkpoints").exists()


class _RunsCode:
    def __reduce__(self):
        return print, ("the payload ran",)


# --- 5. generate's and eval's arguments -------------------------------------------------------------------------

@pytest.mark.slow
def test_generate_names_the_argument_and_the_lengths(tiny_dirs):
    run = tiny_dirs / "run"
    cases = [
        (["--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens must be at least 1, got 0"),
        (["--prompt", "hi", "--max-new-tokens", "-2"], "--max-new-tokens must be at least 1, got -2"),
        (["--prompt", "hi", "--prompt", ""], "--prompt 2 is empty (no tokens): every prompt needs at least one"),
        (["--prompt", "hi", "--prompt", "x" * 30, "--max-new-tokens", "5"],
         "--prompt 2 is 30 tokens; with --max-new-tokens 5 that is 35, more than the model's context (max_seq_len 32): "
         "shorten the prompt or lower --max-new-tokens"),
    ]
    for arguments, message in cases:
        result = _run("-m", "diffjax.generate", "--checkpoint", run / "checkpoints" / "0", *arguments)
        assert (result.returncode, result.stdout, result.stderr) == (2, "", f"error: {message}\n"), arguments


@pytest.mark.slow
def test_eval_with_an_unknown_task_is_one_line():
    pytest.importorskip("lm_eval")
    result = _run("-m", "diffjax.eval", "--model-path", REPO_ROOT, "--tasks", "hellaswag,no_such_task")
    assert (result.returncode, result.stderr) == (2, "error: --tasks: unknown task(s) no_such_task (not in lm_eval's "
                                                     "tasks; `python -m lm_eval ls tasks` lists lm_eval's)\n")
