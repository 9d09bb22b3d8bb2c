"""Adoption (`python -m diffjax.checkpoint adopt`) takes only what diffjax could have written before it kept digests
(issue 55 items 1, 2): never a checkpoint whose digest went missing in a run that has digests, never a conversion
that did not finish. Tiny params-only checkpoints (the converter's format), no training; the trainer's checkpoints
and adoption of a whole trained run: test_missing_digest.py."""

from __future__ import annotations

import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from diffjax.checkpoint import AdoptionRefused, DamagedCheckpointError, adopt, load_params, save_params
from diffjax.config import ModelConfig
from diffjax.model import TransformerLM

CONFIG = ModelConfig(vocab_size=257, d_model=16, num_layers=1, num_heads=2, max_seq_len=32)


def _params(seed: int) -> dict:
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(TransformerLM(CONFIG, rngs=nnx.Rngs(seed)), nnx.Param)))


@pytest.fixture(scope="module")
def digested_run(tmp_path_factory):
    """A run with digests whose checkpoints 39 and 40 hold different params."""
    root = tmp_path_factory.mktemp("digested")
    save_params(root / "run", _params(0), CONFIG, step=39)
    save_params(root / "other", _params(1), CONFIG, step=40)
    shutil.move(root / "other" / "checkpoints" / "40", root / "run" / "checkpoints" / "40")
    return root / "run"


def test_adopt_refuses_a_step_whose_digest_went_missing_in_a_run_with_digests(digested_run, tmp_path, capsys):
    """The probe: step 40's digest removed and its state swapped for step 39's. Before: adopted (rc 0), and the
    trainer then called the run complete on the wrong state."""
    from diffjax.adoption import main

    run_dir = tmp_path / "run"
    shutil.copytree(digested_run, run_dir)
    step_dir = run_dir / "checkpoints" / "40"
    (step_dir / "digest.json").unlink()
    shutil.rmtree(step_dir / "state")
    shutil.copytree(run_dir / "checkpoints" / "39" / "state", step_dir / "state")
    for path in (step_dir, run_dir):
        with pytest.raises(AdoptionRefused, match=rf"^adopt: checkpoint {step_dir} was not adopted: it has no "
                                                  r"digest.json, unlike the other checkpoints of its run, so it is "
                                                  r"damaged .*nothing was written"):
            adopt(path)
    assert main(["adopt", str(step_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: adopt: ") and "\n" not in err, err
    assert not (step_dir / "digest.json").exists()
    # The readers' refusal names the run directory, not adoption; given the run they read step 39.
    with pytest.raises(DamagedCheckpointError, match=rf"it was not read \(name the run directory {run_dir} to read "
                                                     "its newest intact checkpoint\\)$") as refused:
        load_params(step_dir)
    assert "diffjax.checkpoint adopt" not in str(refused.value)
    jax.tree.map(np.testing.assert_array_equal, load_params(run_dir), _params(0))


_KILLED_MID_FILL = """
import os, signal, sys
import numpy as np
from diffjax.config import ModelConfig
from diffjax.params_checkpoint import save_params_streamed

leaves = {("blocks", "w"): ((3, 4, 5), np.dtype(np.float32)), ("embed",): ((7, 4), np.dtype(np.float32))}

def fill(write):
    write(("embed",), None, np.ones((7, 4), np.float32))
    os.kill(os.getpid(), signal.SIGKILL)  # as kill -9 of hf-to-diffjax or merge-lora mid-fill

save_params_streamed(sys.argv[1], leaves, fill, ModelConfig())
"""


def test_a_conversion_killed_mid_fill_leaves_nothing_readable_or_adoptable(tmp_path):
    """The probe: kill -9 of a streamed conversion once Orbax has written its placeholders. Before: checkpoints/0
    of zeros without a digest, which every reader refused with advice to adopt it, and adopt took (rc 0)."""
    import subprocess
    import sys

    from test_reliability_lines import REPO_ROOT

    run_dir = tmp_path / "run"
    killed = subprocess.run([sys.executable, "-c", _KILLED_MID_FILL, str(run_dir)], cwd=REPO_ROOT, timeout=300)
    assert killed.returncode == -9
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "config.yaml").exists()
    unfinished = rf"{run_dir / 'incomplete-checkpoint'} holds a conversion that did not finish: convert again"
    with pytest.raises(FileNotFoundError, match=rf"no checkpoint under {run_dir} \({unfinished}"):
        load_params(run_dir)
    with pytest.raises(FileNotFoundError, match=unfinished):
        adopt(run_dir)
    with pytest.raises(AdoptionRefused, match="was never completed .*: it is not a checkpoint; convert again"):
        adopt(run_dir / "incomplete-checkpoint" / "0")
    assert not list(run_dir.rglob("digest.json"))

    # What the converters left before (the same step in checkpoints/): its never-written leaf refuses adoption.
    (run_dir / "checkpoints").mkdir()
    (run_dir / "incomplete-checkpoint" / "0").rename(run_dir / "checkpoints" / "0")
    with pytest.raises(AdoptionRefused, match=r"params\.blocks\.w \(layer 0\) holds only zeros: it was never written"):
        adopt(run_dir)
    assert not list(run_dir.rglob("digest.json"))
