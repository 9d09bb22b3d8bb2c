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
