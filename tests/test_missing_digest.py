"""A checkpoint without its digest is never read silently (issue 45 item 1). Where the run's other checkpoints have
digests, one without is damage: the trainer sets it aside and resumes from the newest intact one, readers refuse it
by name and, given the run directory, read the newest intact step saying so. A run where no checkpoint has a digest
is read only once adopted (`python -m diffjax.checkpoint adopt`), which refuses what is not finite. Real checkpoints
of the real trainer (one tiny run, copied for each test)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from diffjax.checkpoint import DamagedCheckpointError, NotAdoptedError, load_model, load_params, resolve_checkpoint
from diffjax.train import train
from diffjax.train.config import CheckpointConfig
from diffjax.train.state_checkpoints import Checkpointer
from test_checkpoint_integrity import _flip_a_byte, _largest_state_file, _one_line_error
from test_robustness import _main
from test_trainer import REPO_ROOT, SMALL, _config

RUN = ["train.steps=4", "checkpoint.every=2", "train.sample_tokens=0"]  # checkpoints 2 and 4
ADOPT = "diffjax-checkpoint adopt"
MISSING = "it has no digest.json, unlike the other checkpoints of its run"

pytestmark = pytest.mark.slow  # the trained run: ~15 s once for the module


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    train(_config(run_dir, *RUN), log=lambda _: None)
    return run_dir


@pytest.fixture
def probed_run(trained_run, tmp_path):
    """The probe: a copy of the trained run whose newest checkpoint (4) lost its digest, then one byte."""
    run_dir = tmp_path / "run"
    shutil.copytree(trained_run, run_dir)
    step_dir = run_dir / "checkpoints" / "4"
    (step_dir / "digest.json").unlink()
    _flip_a_byte(_largest_state_file(step_dir))
    return run_dir


def _leaves_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_the_trainer_sets_the_probed_checkpoint_aside_and_retrains_it_bitwise(trained_run, probed_run):
    original = Checkpointer(trained_run, CheckpointConfig()).read(4)
    lines = []
    train(_config(probed_run, *RUN), log=lines.append)
    step_dir = probed_run / "checkpoints" / "4"
    assert (f"warning: checkpoint {step_dir} is damaged ({MISSING}); skipped it and moved it to "
            f"{probed_run / 'damaged-checkpoints' / '4'}") in lines, lines
    assert f"resumed from {probed_run / 'checkpoints' / '2'} (step 2)" in lines, lines
    # Step 4 trained again from step 2: the same state as the run saved before the damage (no corrupted leaf kept).
    _leaves_equal(Checkpointer(probed_run, CheckpointConfig()).read(4), original)


def test_readers_refuse_the_probed_step_and_read_the_run_at_step_2_saying_so(trained_run, probed_run, caplog):
    step_dir = probed_run / "checkpoints" / "4"
    for read in (load_params, load_model):
        with pytest.raises(DamagedCheckpointError, match=rf"checkpoint {step_dir} is damaged: {MISSING}; it was not "
                                                          rf"read \(name the run directory {probed_run} to read"):
            read(step_dir)
    params = load_params(probed_run)
    assert (f"warning: checkpoint: reading {probed_run / 'checkpoints' / '2'} (step 2), not the newest checkpoint of "
            f"{probed_run / 'checkpoints'} (step 4): skipped the damaged checkpoint(s) 4 ({MISSING})") in caplog.text
    _leaves_equal(params, load_params(trained_run / "checkpoints" / "2"))
    assert step_dir.is_dir()  # readers move nothing


def test_the_command_line_readers_and_init_from_refuse_the_probed_step(probed_run, tmp_path, capsys):
    from diffjax.analysis import outliers
    from diffjax.convert.__main__ import main as convert
    from diffjax.generate.__main__ import main as generate

    step_dir = probed_run / "checkpoints" / "4"
    message = f"checkpoint {step_dir} is damaged: {MISSING}; it was not read"
    assert message in _one_line_error(capsys, convert(["diffjax-to-hf", str(step_dir), str(tmp_path / "hf")]))
    assert not (tmp_path / "hf").exists()
    assert message in _one_line_error(capsys, generate(["--checkpoint", str(step_dir), "--prompt-ids", "1,2"]))
    assert message in _one_line_error(capsys, outliers.main(["--checkpoint", str(step_dir), "--tokens", "64"]))
    err = _one_line_error(capsys, _main(*SMALL, f"train.run_dir={tmp_path / 'new'}", f"train.init_from={step_dir}"))
    assert err.startswith("error: train.init_from: ") and message in err, err


def test_export_and_generate_read_the_run_at_step_2_and_say_so(probed_run, tmp_path, caplog):
    from safetensors.numpy import load_file

    from diffjax.convert.__main__ import main as convert
    from diffjax.generate.__main__ import main as generate

    used = (f"reading {probed_run / 'checkpoints' / '2'} (step 2), not the newest checkpoint of "
            f"{probed_run / 'checkpoints'} (step 4)")
    assert convert(["diffjax-to-hf", str(probed_run), str(tmp_path / "hf")]) == 0
    assert used in caplog.text
    caplog.clear()
    assert convert(["diffjax-to-hf", str(probed_run / "checkpoints" / "2"), str(tmp_path / "hf2")]) == 0
    exported, expected = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "hf2" / "model.safetensors")
    _leaves_equal(exported, expected)
    assert generate(["--checkpoint", str(probed_run), "--prompt-ids", "1,2", "--max-new-tokens", "2"]) == 0
    assert used in caplog.text


def _adopt(path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "diffjax.checkpoint", "adopt", str(path)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300)


def test_a_run_without_any_digest_is_refused_until_adopted(trained_run, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(trained_run, run_dir)
    for step in (2, 4):
        (run_dir / "checkpoints" / str(step) / "digest.json").unlink()
    refusal = (f"checkpoint {run_dir / 'checkpoints' / '4'} has no digest.json, nor has any checkpoint of its run "
               rf"\(written before diffjax kept digests, or by hand\), so it cannot be verified: if you trust it, "
               rf"adopt the run \(.*\): {ADOPT} {run_dir}$")
    with pytest.raises(NotAdoptedError, match=rf"^--checkpoint: {refusal}"):
        load_model(run_dir, what="--checkpoint")
    with pytest.raises(NotAdoptedError, match=rf"^checkpoint: {refusal}"):
        load_params(run_dir / "checkpoints" / "4")
    train_argv = (*SMALL, *RUN, f"train.run_dir={run_dir}")
    assert _main(*train_argv) == 2  # the trainer: one line, nothing moved
    assert __import__("re").search(rf"^error: {refusal}", capsys.readouterr().err.strip())
    assert not (run_dir / "damaged-checkpoints").exists()

    adopted = _adopt(run_dir)
    assert adopted.returncode == 0, adopted.stderr
    assert [line.split(":")[0] for line in adopted.stdout.splitlines()] == [
        f"adopted {run_dir / 'checkpoints' / str(step)}" for step in (2, 4)]
    assert resolve_checkpoint(run_dir) == run_dir / "checkpoints" / "4"
    _leaves_equal(load_params(run_dir), load_params(trained_run))
    assert _adopt(run_dir).stdout.startswith("nothing to adopt: every checkpoint")


def test_adoption_refuses_a_checkpoint_that_is_not_finite_and_writes_nothing(trained_run, tmp_path):
    from diffjax.checkpoint import save_params, saved_model_config

    params = load_params(trained_run)
    params["blocks"]["mlp"]["up_kernel"][1, 0, 3] = np.nan  # a hand-made run, as a script would save it
    step_dir = save_params(tmp_path / "by_hand", params, saved_model_config(trained_run / "checkpoints" / "4"))
    (step_dir / "digest.json").unlink()
    refused = _adopt(tmp_path / "by_hand")
    assert refused.returncode == 2
    assert refused.stderr.strip() == (f"error: adopt: checkpoint {step_dir} was not adopted: params.blocks.mlp.up_kernel:"
                                      f" 1 of its {params['blocks']['mlp']['up_kernel'].size} values are not finite; "
                                      "no digest was written"), refused.stderr
    assert not (step_dir / "digest.json").exists()
    with pytest.raises(NotAdoptedError):
        load_params(tmp_path / "by_hand")


def test_adoption_never_replaces_a_digest(probed_run):
    step_dir = probed_run / "checkpoints" / "2"
    _flip_a_byte(_largest_state_file(step_dir))
    digest = (step_dir / "digest.json").read_text()
    refused = _adopt(step_dir)
    assert refused.returncode == 2 and "has a digest.json and is damaged against it" in refused.stderr, refused.stderr
    assert (step_dir / "digest.json").read_text() == digest
