"""Adopting checkpoints that have no digest (a run written before diffjax kept digests, or by hand): every reader
refuses them until `diffjax-checkpoint adopt RUN_DIR_OR_STEP` restores each one, checks that every
floating-point array in it is finite and writes its digest (diffjax.integrity).

Adoption is the one place a checkpoint is trusted without a digest to check it against: it refuses what it can
tell is wrong (an item Orbax cannot restore, a NaN or an infinity) and writes nothing then; a changed byte that
leaves a finite value it cannot tell. A checkpoint that has a digest is never adopted again: its digest stands.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from diffjax import integrity, storage
from diffjax.params_checkpoint import int_keys
from diffjax.run_dir import DATA_ITEM, RunDir, state_dir
from diffjax.sharding import key_names


class AdoptionRefused(ValueError):
    """A checkpoint that cannot be adopted (unreadable, not finite, or damaged against the digest it has)."""


def adopt(path: str | Path) -> list[Path]:
    """Adopts the checkpoints without a digest of a run directory (every step in its checkpoints/) or one step
    directory: each is restored and checked before any digest is written, so a refusal (AdoptionRefused, one line)
    writes none. Returns the step directories adopted (none: every one already had its digest)."""
    run, newest = RunDir.for_reading(path, "adopt")
    named = storage.absolute(path) == newest
    candidates = [newest] if named else [run.step_dir(step) for step in run.steps()]
    undigested = [step_dir for step_dir in candidates if not integrity.has_digest(step_dir)]
    if named and not undigested and (problem := integrity.find_damage(newest)) is not None:
        raise AdoptionRefused(f"adopt: checkpoint {newest} has a {integrity.DIGEST_FILE} and is damaged against it "
                              f"({problem}): adoption never replaces a digest")
    for step_dir in undigested:
        if (problem := _restore_problem(step_dir)) is not None:
            raise AdoptionRefused(f"adopt: checkpoint {step_dir} was not adopted: {problem}; no digest was written")
    for step_dir in undigested:
        integrity.write_digest(step_dir)
    return undigested


def _restore_problem(step_dir: Path) -> str | None:
    """Why a checkpoint cannot be trusted once restored: an item Orbax cannot restore, or an array that is not
    finite (None: every item restores and every floating-point value is finite). The state is restored one top-level
    entry at a time (params, then the optimizer state, ...): host memory holds the largest, not all of them."""
    import orbax.checkpoint as ocp

    checkpointer = ocp.PyTreeCheckpointer()
    try:
        saved = checkpointer.metadata(state_dir(step_dir)).item_metadata
        for key in saved.keys():
            target = {key: int_keys(jax.tree.map(lambda m: np.empty(m.shape, m.dtype), saved[key]))}
            restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), target)
            restored = checkpointer.restore(state_dir(step_dir), args=ocp.args.PyTreeRestore(
                target, restore_args=restore_args, partial_restore=True))
            if (problem := _non_finite(restored)) is not None:
                return problem
            del restored
        if (step_dir / DATA_ITEM).is_dir():
            ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(step_dir / DATA_ITEM)
    except Exception as error:  # whatever Orbax or tensorstore met: not restorable, so not adoptable
        return f"it cannot be restored ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})"
    return None


def _non_finite(tree) -> str | None:
    """'<path>: <n> of its <size> values are not finite' for the first such array of a pytree."""
    for path, array in jax.tree_util.tree_leaves_with_path(tree):
        if jnp.issubdtype(array.dtype, jnp.inexact):  # (numpy alone does not count bfloat16)
            if bad := int(array.size - np.count_nonzero(np.isfinite(array))):
                return f"{'.'.join(key_names(path))}: {bad} of its {array.size} values are not finite"
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="diffjax-checkpoint",
                                     description="Tools for diffjax checkpoints.")
    commands = parser.add_subparsers(dest="command", required=True)
    adopt_parser = commands.add_parser(
        "adopt", help="trust checkpoints that have no digest: restore each, check it is finite, write its digest")
    adopt_parser.add_argument("path", metavar="RUN_DIR_OR_STEP",
                              help="a run directory (every checkpoint without a digest) or one step directory")
    args = parser.parse_args(argv)
    try:
        adopted = adopt(args.path)
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for step_dir in adopted:
        print(f"adopted {step_dir}: it restores, every value is finite; wrote its {integrity.DIGEST_FILE}")
    if not adopted:
        print(f"nothing to adopt: every checkpoint in {args.path} has its {integrity.DIGEST_FILE}")
    return 0
