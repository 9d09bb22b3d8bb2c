"""diffjax.run_dir owns the run directory's layout: its paths, the four ways to open one, and no other module
spells the layout's names."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from diffjax import run_dir
from diffjax.run_dir import RunDir

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_paths_and_steps(tmp_path):
    run = RunDir(tmp_path)
    assert (run.config_file, run.checkpoints, run.metrics_file, run.tensorboard, run.hf, run.damaged_checkpoints) == (
        tmp_path / "config.yaml", tmp_path / "checkpoints", tmp_path / "metrics.jsonl", tmp_path / "tensorboard",
        tmp_path / "hf", tmp_path / "damaged-checkpoints")
    assert run.steps() == [] and not run.has_checkpoints()
    for step in (10, 2):
        (run.step_dir(step) / "state").mkdir(parents=True)
    (run.checkpoints / "3.orbax-checkpoint-tmp-1").mkdir()  # an unfinished save
    (run.checkpoints / "7").mkdir()  # no state item: not a checkpoint
    assert run.steps() == [2, 10] and run.has_checkpoints()
    assert RunDir.of_step(run.step_dir(10)) == run


def test_for_reading_resolves_a_run_its_checkpoints_or_a_step(tmp_path):
    run = RunDir(tmp_path / "run")
    for step in (1, 5):
        (run.step_dir(step) / "state").mkdir(parents=True)
    for given in (run.path, run.checkpoints, run.step_dir(5)):
        opened, step_dir = RunDir.for_reading(given)
        assert opened.path == run.path.absolute() and step_dir == run.step_dir(5).absolute()
    assert RunDir.for_reading(run.step_dir(1))[1].name == "1"
    with pytest.raises(FileNotFoundError, match=r"train.init_from: .*missing is not a run directory or checkpoint"):
        RunDir.for_reading(tmp_path / "missing", "train.init_from")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"--checkpoint: no checkpoint under .*empty"):
        RunDir.for_reading(tmp_path / "empty", "--checkpoint")


def test_for_training_and_for_conversion(tmp_path):
    assert RunDir.for_training(tmp_path / "a" / "b").path.is_dir()
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="train.run_dir .*file exists and is not a directory"):
        RunDir.for_training(tmp_path / "file")
    target = tmp_path / "converted"
    RunDir.for_conversion(target, overwrite=False)
    for name in ("config.yaml", "notes.txt"):
        (target / name).write_text("x")
    (target / "checkpoints" / "0").mkdir(parents=True)
    with pytest.raises(FileExistsError, match="is not empty; choose an empty or new directory, or pass --overwrite"):
        RunDir.for_conversion(target, overwrite=False)
    RunDir.for_conversion(target, overwrite=True).remove_conversion_outputs()  # what a conversion writes, nothing else
    assert sorted(p.name for p in target.iterdir()) == ["notes.txt"]


def test_no_other_module_spells_the_layout():
    """The layout's names appear as string literals in diffjax/run_dir.py only (so a change of layout is one edit)."""
    names = [run_dir.CONFIG_FILE, run_dir.CHECKPOINTS_DIR, run_dir.METRICS_FILE, run_dir.DIGEST_FILE,
             run_dir.DAMAGED_DIR, run_dir.TENSORBOARD_DIR]
    pattern = re.compile("|".join(rf"[\"']{re.escape(name)}[\"']" for name in names) + r"|/ [\"']hf[\"']|/ [\"']state[\"']")
    offenders = []
    for path in sorted([*(REPO_ROOT / "diffjax").rglob("*.py"), *(REPO_ROOT / "benchmarks").glob("*.py"), REPO_ROOT / "train.py"]):
        if path.name == "run_dir.py" and path.parent.name == "diffjax":
            continue
        offenders += [f"{path.relative_to(REPO_ROOT)}:{number}: {line.strip()}"
                      for number, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not offenders, "\n".join(offenders)


def _lines_matching(pattern: re.Pattern, owner: str) -> list[str]:
    return [f"{path.relative_to(REPO_ROOT)}:{number}: {line.strip()}"
            for path in sorted((REPO_ROOT / "diffjax").rglob("*.py")) if path.relative_to(REPO_ROOT).as_posix() != owner
            for number, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]


def test_a_run_dir_is_opened_by_its_owner_only():
    """Outside run_dir.py a RunDir comes from one of its openers (for_training, for_reading, for_conversion,
    for_params, of_step), each with its checks, never from a bare RunDir(path)."""
    assert not _lines_matching(re.compile(r"(?<![\w.])RunDir\("), "diffjax/run_dir.py")


def test_the_train_state_keys_are_spelled_by_state_layout_only():
    """The state's keys are diffjax.state_layout's names ("params", "step" and "rng" are common words elsewhere:
    its distinctive keys are searched)."""
    assert not _lines_matching(re.compile(r"[\"'](opt_state|base_checksums)[\"']"), "diffjax/state_layout.py")


def test_the_trainer_lock_refuses_a_second_holder_and_takes_over_a_dead_ones(tmp_path):
    import subprocess
    import sys

    from diffjax.run_dir import RunDirInUseError

    run = RunDir.for_training(tmp_path / "run")
    lock = run.lock_for_training()
    assert lock.took_over is None and json.loads(run.lock_file.read_text())["pid"] == os.getpid()
    with pytest.raises(RunDirInUseError, match=rf"train.run_dir {run.path} is in use by another trainer \(pid {os.getpid()} "):
        run.lock_for_training()
    lock.release()
    assert not run.lock_file.exists()
    # A holder that dies without releasing (kill -9): its record stays, its flock goes with it.
    code = f"import os; from diffjax.run_dir import RunDir; RunDir({str(run.path)!r}).lock_for_training(); os._exit(0)"
    subprocess.run([sys.executable, "-c", code], check=True)
    taken = run.lock_for_training()
    assert taken.took_over["pid"] != os.getpid() and "left by a trainer that is no longer running" in taken.describe_takeover()
    taken.release()
