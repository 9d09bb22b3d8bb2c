"""Adopting checkpoints that have no digest (a run written before diffjax kept digests, or by hand): every reader
refuses them until `diffjax-checkpoint adopt RUN_DIR_OR_STEP` restores each one, checks that every
floating-point array in it is finite and writes its digest (diffjax.integrity).

Adoption is the one place a checkpoint is trusted without a digest to check it against, so it takes only what
diffjax could have written before it kept digests: a run in which no checkpoint, kept or set aside, has one (where
others have theirs, a missing digest is damage). It refuses what it can tell is wrong (an item Orbax cannot restore,
a NaN or an infinity) and writes nothing then; a changed byte that leaves a finite value it cannot tell. A checkpoint
that has a digest is never adopted again: its digest stands.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from diffjax import command_line, integrity, storage
from diffjax.log_lines import os_error_line
from diffjax.params_checkpoint import int_keys, is_stacked
from diffjax.run_dir import DATA_ITEM, INCOMPLETE_DIR, RunDir, RunDirInUseError, state_dir
from diffjax.sharding import key_names
from diffjax.state_layout import PARAMS


class AdoptionRefused(ValueError):
    """A checkpoint that cannot be adopted (unreadable, not finite, or damaged against the digest it has)."""


def adopt(path: str | Path) -> list[Path]:
    """Adopts the checkpoints without a digest of a run directory (every step in its checkpoints/) or one step
    directory: each is restored and checked before any digest is written, so a refusal (AdoptionRefused, one line)
    writes none. Returns the step directories adopted (none: every one already had its digest)."""
    run, newest = RunDir.for_reading(path, "adopt")
    if newest.parent.name == INCOMPLETE_DIR:
        raise AdoptionRefused(f"adopt: {newest} was never completed (a conversion or merge that did not finish writes "
                              "there): it is not a checkpoint; convert again with --overwrite")
    named = storage.absolute(path) == newest
    candidates = [newest] if named else [run.step_dir(step) for step in run.steps()]
    undigested = [step_dir for step_dir in candidates if not integrity.has_digest(step_dir)]
    if not undigested:
        if named and (problem := integrity.find_damage(newest)) is not None:
            raise AdoptionRefused(f"adopt: checkpoint {newest} has a {integrity.DIGEST_FILE} and is damaged against "
                                  f"it ({problem}): adoption never replaces a digest")
        return []
    if integrity.run_has_digests(run):
        raise AdoptionRefused(
            f"adopt: checkpoint {undigested[0]} was not adopted: {integrity.MISSING_DIGEST}, so it is damaged (adoption "
            f"is for runs written before diffjax kept digests, where no checkpoint has one); nothing was written. "
            f"Readers given {run.path} read its newest intact checkpoint; the trainer sets the damaged one aside")
    if not storage.writable(run.checkpoints):
        raise AdoptionRefused(f"adopt: {run.checkpoints} is not writable (a read-only file system, or no permission): "
                              f"adoption writes a {integrity.DIGEST_FILE} into each checkpoint; copy the run somewhere "
                              "writable and adopt it there")
    lock = run.lock_for_writing("adopt")  # (a trainer may be writing this run)
    try:
        for step_dir in undigested:
            if (problem := _restore_problem(step_dir)) is not None:
                raise AdoptionRefused(f"adopt: checkpoint {step_dir} was not adopted: {problem}; no digest was written")
        for step_dir in undigested:
            integrity.write_digest(step_dir)
    finally:
        lock.release()
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
            problem = _non_finite(restored) or (_never_written(restored) if key == PARAMS else None)
            if problem is not None:
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


def _never_written(tree) -> str | None:
    """'<path> (layer i) holds only zeros: ...' for the first weight matrix of all zeros (each layer of a stacked
    leaf on its own): what a conversion or merge killed before it finished leaves where it had not written yet (its
    placeholders). No trained or converted model has one (zero-initialised parameters are vectors)."""
    for path, array in jax.tree_util.tree_leaves_with_path(tree):
        names = key_names(path)
        if not jnp.issubdtype(array.dtype, jnp.inexact):
            continue
        stacked = is_stacked(names[1:])
        for layer, matrix in enumerate(array if stacked else [array]):
            if sum(size > 1 for size in matrix.shape) >= 2 and not np.count_nonzero(matrix):
                where = f" (layer {layer})" if stacked else ""
                return (f"{'.'.join(names)}{where} holds only zeros: it was never written (a conversion or merge that "
                        "did not finish leaves zeros where it had not written yet)")
    return None


def main(argv=None) -> int:
    parser = command_line.ArgumentParser(prog="diffjax-checkpoint",
                                         description="Tools for diffjax checkpoints.")
    commands = parser.add_subparsers(dest="command", required=True)
    adopt_parser = commands.add_parser(
        "adopt", help="trust checkpoints that have no digest: restore each, check it is finite, write its digest")
    adopt_parser.add_argument("path", metavar="RUN_DIR_OR_STEP",
                              help="a run directory (every checkpoint without a digest) or one step directory")
    args = parser.parse_args(argv)
    try:
        adopted = adopt(args.path)
    except (ValueError, FileNotFoundError, RunDirInUseError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # a digest that could not be written (a full disk): it was written atomically, or not
        print(f"error: adopt: {os_error_line(error)}", file=sys.stderr)
        return 1
    for step_dir in adopted:
        print(f"adopted {step_dir}: it restores, every value is finite; wrote its {integrity.DIGEST_FILE}")
    if not adopted:
        print(f"nothing to adopt: every checkpoint in {args.path} has its {integrity.DIGEST_FILE}")
    return 0
