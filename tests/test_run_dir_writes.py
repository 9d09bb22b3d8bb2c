"""Commands that write a run directory or an export (issue 55 items 3, 5, 6, 8): each holds the run's trainer.lock
before it removes or writes anything, never writes into the Hugging Face cache, and a read-only or full disk is one
line with nothing partial left. A tiny params-only run and its HF export, no training. Full and read-only disks are
small tmpfs mounts (root only; those tests skip elsewhere)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from flax import nnx

from diffjax.config import ModelConfig
from diffjax.model import TransformerLM

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG = ModelConfig(vocab_size=257, d_model=32, num_layers=1, num_heads=2, max_seq_len=32)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(a params-only run directory, its HF export)."""
    from diffjax.convert.hf_directories import diffjax_to_hf
    from diffjax.params_checkpoint import save_params

    root = tmp_path_factory.mktemp("writes")
    save_params(root / "run", nnx.to_pure_dict(nnx.state(TransformerLM(CONFIG, rngs=nnx.Rngs(0)), nnx.Param)), CONFIG)
    diffjax_to_hf(root / "run", root / "hf")
    return root / "run", root / "hf"


def _listing(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _one_line(capsys, code: int, expected_code: int = 2) -> str:
    err = capsys.readouterr().err.strip()
    assert code == expected_code and len(err.splitlines()) == 1, (code, err)
    return err


# --- 3. a conversion or adoption into a run directory a trainer holds ----------------------------------------------

def test_a_conversion_or_adoption_is_refused_while_a_trainer_holds_the_run(tiny, tmp_path, capsys):
    """The probe: `hf-to-diffjax SRC RUN --overwrite` with a trainer running in RUN. Before: config.yaml and the
    checkpoints deleted under the trainer, then a traceback-free failure naming a missing file."""
    from diffjax.adoption import main as adopt
    from diffjax.convert.__main__ import main as convert
    from diffjax.run_dir import RunDir

    run_dir = tmp_path / "run"
    shutil.copytree(tiny[0], run_dir)
    before = _listing(run_dir)
    trainer = RunDir(run_dir).lock_for_training()  # as the trainer holds it (a second flock is refused in-process too)
    try:
        held = f"run directory {run_dir} is in use by a trainer (pid {os.getpid()} "
        err = _one_line(capsys, convert(["hf-to-diffjax", str(tiny[1]), str(run_dir), "--overwrite"]))
        assert err.startswith(f"error: hf-to-diffjax: {held}"), err  # (upcycle and merge-lora: the same code)
        (run_dir / "checkpoints" / "0" / "digest.json").unlink()  # something to adopt
        err = _one_line(capsys, adopt(["adopt", str(run_dir)]))
        assert err.startswith(f"error: adopt: {held}"), err
        (run_dir / "checkpoints" / "0" / "digest.json").write_bytes(before["checkpoints/0/digest.json"])
    finally:
        trainer.release()
    assert _listing(run_dir) == before
    # Once it is free, the conversion holds it while it runs (a trainer started then is refused naming it) and
    # gives it back.
    from diffjax.convert import hf_directories

    seen = []
    real = hf_directories.save_params_streamed

    def save_params_streamed(*args, **kwargs):
        try:
            RunDir(run_dir).lock_for_training()
        except OSError as refused:
            seen.append(str(refused))
        return real(*args, **kwargs)

    hf_directories.save_params_streamed = save_params_streamed
    try:
        assert convert(["hf-to-diffjax", str(tiny[1]), str(run_dir), "--overwrite"]) == 0
    finally:
        hf_directories.save_params_streamed = real
    assert seen and seen[0].startswith(f"train.run_dir {run_dir} is in use by hf-to-diffjax (pid {os.getpid()} "), seen
    assert not (run_dir / "trainer.lock").exists()


# --- 6, 8. a full or read-only disk -----------------------------------------------------------------------------

@pytest.fixture
def disk(tmp_path):
    """disk(kib, read_only=False, holding=None): a tmpfs of that size (with a copy of `holding` in it, then made
    read-only if asked), unmounted after the test."""
    mounted = []

    def mount(kib: int, read_only: bool = False, holding: Path | None = None) -> Path:
        path = tmp_path / f"disk{len(mounted)}"
        path.mkdir()
        if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(path)],
                          capture_output=True).returncode:
            pytest.skip("cannot mount a tmpfs here (not root)")
        mounted.append(path)
        if holding is not None:
            shutil.copytree(holding, path / holding.name)
        if read_only:
            subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True)
        return path

    yield mount
    for path in mounted:
        subprocess.run(["umount", str(path)], check=True)


def _cli(*command):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run([sys.executable, *map(str, command)], capture_output=True, text=True, cwd=REPO_ROOT,
                            env=env, timeout=300)
    lines = [line for line in result.stderr.splitlines() if not line.startswith("  [")]  # the converter's progress
    return result.returncode, lines


@pytest.mark.slow
def test_an_export_onto_a_full_disk_is_one_line_and_leaves_nothing(tiny, disk):
    """Before: a 19-line traceback and a partial model.safetensors (issue 55 item 6)."""
    full = disk(60)
    code, lines = _cli("-m", "diffjax.convert", "diffjax-to-hf", tiny[0], full / "hf")
    assert code == 1 and len(lines) == 1, lines
    assert lines[0] == f"error: writing the export {full / 'hf'} failed: No space left on device; nothing of it was kept"
    assert list(full.iterdir()) == []


@pytest.mark.slow
def test_a_read_only_disk_is_one_line_for_conversions_exports_and_adoption(tiny, disk, tmp_path):
    """Before: 22- and 26-line tracebacks (issue 55 item 8)."""
    read_only = disk(1024, read_only=True)
    for command in ("hf-to-diffjax", "diffjax-to-hf"):
        src = tiny[1] if command == "hf-to-diffjax" else tiny[0]
        code, lines = _cli("-m", "diffjax.convert", command, src, read_only / "out")
        writer = "conversion" if command == "hf-to-diffjax" else "export"
        assert code == 2 and lines == [f"error: {read_only / 'out'} is not writable (a read-only file system, or no "
                                       f"permission): choose a directory the {writer} can write"], lines
    unadopted = tmp_path / "run"
    shutil.copytree(tiny[0], unadopted)
    (unadopted / "checkpoints" / "0" / "digest.json").unlink()
    run_dir = disk(1024, read_only=True, holding=unadopted) / "run"
    code, lines = _cli("-m", "diffjax.checkpoint", "adopt", run_dir)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"error: adopt: {run_dir / 'checkpoints'} is not writable"), lines
