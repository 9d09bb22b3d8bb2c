"""The import path of params-only checkpoints for users and scripts (`from diffjax.checkpoint import load_model`):
the code is in diffjax/params_checkpoint.py; the run directory's layout in diffjax/run_dir.py; the trainer's
own checkpoints in diffjax/train/state_checkpoints.py.

`diffjax-checkpoint adopt RUN_DIR_OR_STEP` (also `python -m diffjax.checkpoint`) adopts checkpoints that have no digest
(diffjax/adoption.py)."""

from diffjax.params_checkpoint import *  # noqa: F401,F403
from diffjax.adoption import AdoptionRefused, adopt  # noqa: F401
from diffjax.integrity import NotAdoptedError  # noqa: F401
from diffjax.params_checkpoint import (  # noqa: F401  (names the tests and tools use that * would also give)
    CheckpointParams,
    load_model,
    load_params,
    resolve_checkpoint,
    save_params,
    saved_model_config,
)

if __name__ == "__main__":
    from diffjax.adoption import main
    from diffjax.command_line import run

    run(main, "diffjax-checkpoint")
