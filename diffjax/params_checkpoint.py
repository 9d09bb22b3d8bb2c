"""Params-only checkpoints: the format the converter writes, `load_model` reads and train.py trains on from.
Users import it as `diffjax.checkpoint`. In the run directory (diffjax/run_dir.py):

    <run_dir>/config.yaml               `model`: the ModelConfig (a run config: train.py resumes from it)
    <run_dir>/checkpoints/<step>/state  Orbax, {"params": nnx pure dict} (a trainer checkpoint adds the
                                        optimizer state, step and RNG; `load_params` reads either)

The decoder blocks' params are stacked over depth ([L, ...] leaves under "blocks"). Checkpoints written
before that (one "blocks/<i>" entry per layer) are stacked on read by `load_params`, `load_model` and
`CheckpointParams`. Orbax is imported where a checkpoint is read or written, so that importing this
module (and diffjax.convert) costs nothing. A LoRA run's weights are read merged (`merged_lora_params`, with its
settings and math from diffjax.lora); nothing here imports the trainer.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import yaml

from diffjax import integrity, lora, storage
from diffjax.config import ModelConfig
from diffjax.config_values import read_yaml_mapping
from diffjax.kinds import FIRST_SEGMENT, MTP_STACK, Segment
from diffjax.log_lines import after_a_failed_write, drop_late_write_callbacks
from diffjax.run_dir import DIGEST_FILE, INCOMPLETE_DIR, STATE_ITEM, TEMPORARY_MARK, RunDir, state_dir
from diffjax.sharding import key_names
from diffjax.state_layout import BASE_CHECKSUMS, PARAMS

CHUNK_BYTES = 8 * 2**20


logger = logging.getLogger("diffjax.checkpoint")


class CheckpointWriteError(OSError):
    """Writing a params-only checkpoint or an HF export failed (a full disk, no permission): nothing of it is left
    behind."""


def _write_failure(error: Exception) -> str:
    """The OS's reason from an Orbax / tensorstore error (whose first line also holds a whole tensorstore spec)."""
    text = str(error)
    for reason in ("No space left on device", "Disk quota exceeded", "Permission denied", "Read-only file system"):
        if reason in text:
            return reason
    return (text.splitlines() or [type(error).__name__])[0][:200]


class DamagedCheckpointError(ValueError):
    """A checkpoint's files differ from its digest (or the digest is malformed): it is not read."""


def resolve_checkpoint(path: str | Path, what: str = "checkpoint") -> Path:
    """The one verified step directory to read from `path`, for every reader of a checkpoint (load_params,
    load_model, the converter's export, generate, the analyses, train.init_from).

    `path`: a run directory or its checkpoints/ directory (the newest step whose files match its digest; when that
    is not the newest step, a warning names the step read and each newer damaged one) or a step directory itself
    (refused, DamagedCheckpointError, when damaged). A checkpoint without a digest is damage where its run's other
    checkpoints have one; a run where none has is refused (integrity.NotAdoptedError) until adopted. `what` names
    the setting in errors (e.g. "train.init_from"). Readers move nothing: the trainer sets damaged checkpoints of
    its own run aside when it resumes.
    """
    run, step_dir = RunDir.for_reading(path, what)
    try:
        problem = _damage(step_dir)
    except integrity.NotAdoptedError:
        raise integrity.NotAdoptedError(step_dir, prefix=f"{what}: ") from None
    if problem is None:
        return step_dir
    if storage.absolute(path) == step_dir:
        raise DamagedCheckpointError(f"{what}: checkpoint {step_dir} is damaged: {problem}; it was not read (name "
                                     f"the run directory {run.path} to read its newest intact checkpoint)")
    damaged = [f"{step_dir.name} ({problem})"]
    for step in reversed(run.steps()):
        older = run.step_dir(step)
        if step >= int(step_dir.name):
            continue
        if (problem := _damage(older)) is None:
            logger.warning(f"warning: {what}: reading {older} (step {step}), not the newest checkpoint of "
                           f"{run.checkpoints} (step {step_dir.name}): skipped the damaged checkpoint(s) "
                           f"{'; '.join(damaged)}")
            return older
        damaged.append(f"{step} ({problem})")
    raise DamagedCheckpointError(f"{what}: every checkpoint in {run.checkpoints} is damaged: {'; '.join(damaged)}")


_intact: set[tuple[Path, int]] = set()  # (step dir, digest mtime) verified in this process: hash each once


def _damage(step_dir: Path) -> str | None:
    digest = step_dir / DIGEST_FILE
    key = (step_dir, storage.modified(digest) if digest.exists() else 0)
    if key in _intact:
        return None
    problem = integrity.find_damage(step_dir)
    if problem is None:
        _intact.add(key)
    return problem


class _NoStateMetadataNote(logging.Filter):
    """Drops Orbax's "Metadata file does not exist: .../state/_CHECKPOINT_METADATA" warning, logged on every load
    of a checkpoint's state item (Orbax keeps that file one level up, in the step directory): noise, not damage."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("Metadata file does not exist") and
                    message.endswith(f"{os.sep}{STATE_ITEM}{os.sep}_CHECKPOINT_METADATA"))


class _UnreadableMetadataOnce(logging.Filter):
    """Orbax's "Failed to read / json parse Metadata file" errors about a step's _CHECKPOINT_METADATA, logged at every
    read (three times as a run resumes) with the file's whole content, become one warning per file. The file is
    Orbax's bookkeeping (timestamps, handler names; outside the digest, as Orbax writes it as it commits): Orbax reads
    the checkpoint without it, and the digest has checked the checkpoint's data."""

    def __init__(self):
        super().__init__()
        self.said: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if not (isinstance(record.msg, str) and record.msg.startswith(("Failed to read Metadata file",
                                                                       "Failed to json parse Metadata file"))
                and record.args):
            return True
        path = str(record.args[0])
        if path in self.said:
            return False
        self.said.add(path)
        record.msg, record.args = "warning: %s cannot be read (Orbax's metadata: the checkpoint is read without it)", (path,)
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


logging.getLogger("absl").addFilter(_NoStateMetadataNote())
logging.getLogger("absl").addFilter(_UnreadableMetadataOnce())


def _saved_metadata(step_dir: Path) -> dict:
    import orbax.checkpoint as ocp

    return ocp.PyTreeCheckpointer().metadata(state_dir(step_dir)).item_metadata


def state_keys(step_dir: Path) -> set[str]:
    """Top-level keys of a checkpoint's state: {"params"} alone for a params-only (converted) checkpoint."""
    return set(_saved_metadata(step_dir).keys())


def is_per_layer(saved_params: Mapping) -> bool:
    """True for params saved one entry per layer ({"blocks": {"0": ..., "1": ...}}), the layout before stacking."""
    blocks = saved_params.get(FIRST_SEGMENT)
    return isinstance(blocks, Mapping) and bool(blocks) and all(str(key).isdigit() for key in blocks)


def refuse_per_layer(step_dir: Path, what: str, saved_params: Mapping | None = None) -> None:
    """A clear error for a full train state saved per layer: its optimizer state cannot be resumed as is.
    saved_params: the checkpoint's params metadata when the caller has it (else read from step_dir)."""
    saved = _saved_metadata(step_dir).get(PARAMS) if saved_params is None else saved_params
    if saved is not None and is_per_layer(saved):
        raise ValueError(
            f"{what}: checkpoint {step_dir} stores the decoder blocks' params one entry per layer (written before "
            "diffjax stacked them over depth), so its optimizer state cannot be resumed. Train on from its params "
            f"in a new run directory with train.init_from={step_dir} (they are stacked on read; the optimizer "
            "restarts), or load it with diffjax.checkpoint.load_model"
        )


def stack_layers(params: dict) -> dict:
    """Per-layer params ({"blocks": {i: tree}}) -> stacked ({"blocks": tree of [L, ...]}), host numpy."""
    blocks = params[FIRST_SEGMENT]
    layers = [blocks[key] for key in sorted(blocks, key=int)]
    return {**params, FIRST_SEGMENT: jax.tree.map(lambda *xs: np.stack(xs), *layers)}


def int_keys(tree: Any) -> Any:
    """Digit-string dict keys back to ints (Orbax stores the layer indices of per-layer params as strings)."""
    if not isinstance(tree, dict):
        return tree
    return {int(k) if isinstance(k, str) and k.isdigit() else k: int_keys(v) for k, v in tree.items()}


def check_same_params(saved: Any, expected: Any, message: str) -> None:
    """Raise ValueError(message + the missing, unexpected and mis-shaped parameter paths)."""
    def shapes(tree):
        return {".".join(key_names(path)): tuple(x.shape) for path, x in jax.tree_util.tree_leaves_with_path(tree)}

    saved_shapes, expected_shapes = shapes(saved), shapes(expected)
    problems = []
    if missing := sorted(set(expected_shapes) - set(saved_shapes)):
        problems.append(f"missing {missing}")
    if unexpected := sorted(set(saved_shapes) - set(expected_shapes)):
        problems.append(f"unexpected {unexpected}")
    problems += [
        f"{key} has shape {saved_shapes[key]}, expected {shape}"
        for key, shape in sorted(expected_shapes.items()) if key in saved_shapes and saved_shapes[key] != shape
    ]
    if problems:  # one line: the first few, then how many more
        more = f"; and {len(problems) - 3} more" if len(problems) > 3 else ""
        raise ValueError(f"{message}: {'; '.join(problems[:3])}{more}")


def load_params(path: str | Path, abstract_params: Any = None, *, what: str = "checkpoint") -> Any:
    """The params of a checkpoint (full train state or params-only), without reading the optimizer state.

    `abstract_params` (ShapeDtypeStructs, optionally with shardings) checks shapes and places the arrays;
    None gives host numpy arrays in the saved structure (per-layer checkpoints stacked).
    """
    import orbax.checkpoint as ocp

    step_dir = resolve_checkpoint(path, what)
    checkpointer = ocp.PyTreeCheckpointer()
    saved = checkpointer.metadata(state_dir(step_dir)).item_metadata.get(PARAMS)
    if saved is None:
        raise ValueError(f"{what}: checkpoint {step_dir} holds no params")
    per_layer = is_per_layer(saved)
    message = f"{what}: checkpoint {step_dir} does not match this model"
    if abstract_params is None or per_layer:  # per-layer: read to host, stack, then place
        target = int_keys(jax.tree.map(lambda m: np.empty(m.shape, m.dtype), saved))
        restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), target)
    else:
        check_same_params(saved, abstract_params, message)
        target, restore_args = abstract_params, ocp.checkpoint_utils.construct_restore_args(abstract_params)
    try:
        restored = checkpointer.restore(
            state_dir(step_dir),
            args=ocp.args.PyTreeRestore({PARAMS: target}, restore_args={PARAMS: restore_args}, partial_restore=True),
        )[PARAMS]
    except (ValueError, KeyError) as error:
        raise ValueError(f"{message} ({error})") from None
    if not per_layer:
        return restored
    restored = stack_layers(restored)
    if abstract_params is None:
        return restored
    check_same_params(restored, abstract_params, message)
    return jax.tree.map(lambda x, target: jax.device_put(x.astype(target.dtype), target.sharding), restored, abstract_params)


def save_params(run_dir: str | Path, params: Any, model_config: ModelConfig, *, step: int = 0,
                data: dict | None = None, optim: dict | None = None) -> Path:
    """A params-only checkpoint in run-directory layout: <run_dir>/config.yaml and checkpoints/<step>/state.

    `train.py train.run_dir=<run_dir>` continues training from it (a fresh optimizer), `train.init_from`
    fine-tunes from it and `load_model` loads it. Refuses a directory that already holds checkpoints.
    """
    run = RunDir.for_params(run_dir)
    _write_state(run, step, jax.tree.map(np.asarray, params))  # jax arrays to host numpy (numpy arrays: no copy)
    return _complete(run, step, model_config, data, optim)


def save_params_streamed(run_dir: str | Path, leaves: Mapping[tuple, tuple[tuple, Any]], fill: Callable,
                         model_config: ModelConfig, *, step: int = 0, data: dict | None = None) -> Path:
    """save_params for params that arrive piece by piece (a conversion, shard by shard): peak memory is one piece.

    `leaves`: {path tuple: (shape, dtype)}. The checkpoint is first written by Orbax from zero-stride placeholders
    (so its files are save_params' exactly), then `fill(write)` calls write(path, layer index or None, array) for
    every leaf (each layer of a stacked one), which goes straight into that leaf's zarr array. All of it happens in
    incomplete-checkpoint/ (run_dir.INCOMPLETE_DIR); the step moves into checkpoints/ with its digest, and config.yaml
    follows, only when every piece was written: a killed or failed fill never looks like a checkpoint (a failure
    removes what it wrote)."""
    run = RunDir.for_params(run_dir)
    placeholders = nested({path: np.broadcast_to(np.zeros((), dtype), shape) for path, (shape, dtype) in leaves.items()})
    _write_state(run, step, placeholders)
    writer = _LeafWriter(state_dir(run.incomplete / str(step)), leaves)
    try:
        fill(writer.write)
        writer.check_complete()
    except BaseException:
        storage.rmtree(run.incomplete, ignore_errors=True)
        raise
    return _complete(run, step, model_config, data, None)


class _LeafWriter:
    """Writes arrays into the zarr arrays Orbax wrote (one per leaf, named params.<path>), keeping track of what
    was written so that a missing piece is an error, not a checkpoint of zeros."""

    def __init__(self, directory: Path, leaves: Mapping[tuple, tuple[tuple, Any]]):
        self.directory, self.leaves, self.arrays = directory, leaves, {}
        self.missing = {path: set(range(shape[0])) if is_stacked(path) else {None} for path, (shape, _) in leaves.items()}

    def write(self, path: tuple, index: int | None, array) -> None:
        import tensorstore as ts

        name = ".".join((PARAMS,) + path)
        if path not in self.leaves:
            raise KeyError(f"{name} is no parameter of this checkpoint")
        shape, dtype = self.leaves[path]
        if tuple(np.shape(array)) != (shape if index is None else shape[1:]):
            raise ValueError(f"{name}{'' if index is None else f'[{index}]'} has shape {np.shape(array)}, expected "
                             f"{shape if index is None else shape[1:]}")
        try:
            if path not in self.arrays:
                spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": str(self.directory / name)}}
                self.arrays[path] = ts.open(spec, open=True, write=True).result()
            target = self.arrays[path] if index is None else self.arrays[path][index]
            target.write(np.asarray(array, dtype)).result()
        except ValueError as error:  # tensorstore's I/O errors
            after_a_failed_write()
            raise CheckpointWriteError(f"writing {name} into {self.directory} failed: {_write_failure(error)}; "
                                       "nothing of the checkpoint was kept") from None
        self.missing[path].discard(index)

    def check_complete(self) -> None:
        if missing := sorted(".".join(path) for path, left in self.missing.items() if left):
            raise ValueError(f"no values were written for {', '.join(missing[:3])}" +
                             (f" and {len(missing) - 3} more parameters" if len(missing) > 3 else ""))


def is_stacked(path: tuple) -> bool:
    """Under a layer segment's stack ("blocks", a model of several segments' "blocks_from_<start>") or the MTP
    depths' ("blocks_mtp"): diffjax.kinds.Segment, param_stacks."""
    return Segment.start_of(path[0]) is not None or path[0] == MTP_STACK


def nested(flat: Mapping[tuple, Any]) -> dict:
    """{("blocks", "attn", "q_kernel"): x} -> {"blocks": {"attn": {"q_kernel": x}}} (an nnx pure dict)."""
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


def _write_state(run: RunDir, step: int, params: Any) -> None:
    """Orbax writes {"params": params} (host numpy) as incomplete-checkpoint/<step>/state, which _complete moves
    into checkpoints/ once the checkpoint is complete (a streamed one is filled in between): a kill at any point
    leaves nothing that looks like a checkpoint. A failure leaves nothing."""
    import orbax.checkpoint as ocp

    drop_late_write_callbacks(TEMPORARY_MARK, INCOMPLETE_DIR)  # what a failed write leaves behind besides its error
    # Peak memory ~ the params alone (the converter streams models larger than half the machine's memory):
    # OCDBT would hold the whole encoded checkpoint until it commits, and the default numpy handler copies
    # every array (needed only for asynchronous saves; this one is synchronous).
    registry = ocp.type_handlers.create_type_handler_registry(
        (np.ndarray, ocp.type_handlers.NumpyHandler(deepcopy_host_arrays=False))
    )
    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=False, save_concurrent_gb=1, type_handler_registry=registry)
    manager = ocp.CheckpointManager(run.incomplete, item_handlers={STATE_ITEM: handler},
                                    options=ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False))
    # Written in chunks of at most CHUNK_BYTES, stacked leaves split along the layers axis first: the encoding
    # transient is one chunk, not a whole stack, and CheckpointParams.layer (and _LeafWriter) touch only one
    # layer's chunks.
    save_args = jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=CHUNK_BYTES), params)
    for name in params:
        if is_stacked((name,)):
            save_args[name] = jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=CHUNK_BYTES, shard_axes=(0,)), params[name])
    try:
        manager.save(step, args=ocp.args.Composite(**{STATE_ITEM: ocp.args.PyTreeSave({PARAMS: params},
                                                                                        save_args={PARAMS: save_args})}),
                     force=True)
        manager.wait_until_finished()
    except Exception as error:  # Orbax raises tensorstore's write errors as ValueError
        manager.close()  # first: its threads may still be writing (tensorstore's can still re-create the directory)
        storage.rmtree(run.incomplete, ignore_errors=True)
        after_a_failed_write()
        raise CheckpointWriteError(f"writing the checkpoint {run.step_dir(step)} failed: {_write_failure(error)}; "
                                   "nothing of it was kept") from None
    manager.close()


def _complete(run: RunDir, step: int, model_config: ModelConfig, data: dict | None, optim: dict | None) -> Path:
    written = run.incomplete / str(step)
    integrity.write_digest(written)  # its readers verify it (resolve_checkpoint)
    run.checkpoints.mkdir(exist_ok=True)
    storage.move(written, run.step_dir(step))  # the checkpoint appears complete, with its digest
    storage.rmtree(run.incomplete, ignore_errors=True)
    # A run config train.py reads (its other sections take their defaults); the data section's sequence
    # length must fit the model; `data` adds to that section (a conversion names its tokenizer there), `optim` is
    # the optim section (an upcycled model's lambda warm-up).
    run_config = {"model": model_config.to_dict(), "data": {"seq_len": min(128, model_config.max_seq_len), **(data or {})},
                  **({"optim": optim} if optim else {}), "train": {"run_dir": str(run.path)}}
    storage.write_text_atomically(run.config_file, yaml.safe_dump(run_config, sort_keys=False))
    return run.step_dir(step)


def saved_model_config(step_dir: Path, *, what: str = "checkpoint") -> ModelConfig:
    """The ModelConfig of a checkpoint: the `model` section of its run directory's config.yaml."""
    config_path = RunDir.of_step(step_dir).config_file
    if not config_path.exists():
        raise FileNotFoundError(f"{what}: {config_path} is missing: cannot tell which model {step_dir} holds")
    model = read_yaml_mapping(config_path).get("model")
    if not isinstance(model, dict):
        raise ValueError(f"{what}: {config_path} has no `model` section")
    return ModelConfig.from_dict(model)


def load_model(path: str | Path, *, what: str = "checkpoint"):
    """The TransformerLM of a run directory or checkpoint (its config.yaml's model section, its saved params).
    A LoRA run's model is its base (train.init_from) with the adapters merged (diffjax.convert.lora_merge)."""
    from flax import nnx

    from diffjax.model import TransformerLM

    step_dir = resolve_checkpoint(path, what)
    model_config = saved_model_config(step_dir, what=what)
    abstract_model = nnx.eval_shape(lambda: TransformerLM(model_config, rngs=nnx.Rngs(0)))
    graphdef, abstract_params = nnx.split(abstract_model, nnx.Param)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), nnx.to_pure_dict(abstract_params))
    params = load_model_params(step_dir, target, what=what)
    nnx.replace_by_pure_dict(abstract_params, params)
    return nnx.merge(graphdef, abstract_params)


# --- LoRA runs: a checkpoint holds the adapters; the model is its base (train.init_from) with them merged ----------

def _read_state_items(step_dir: Path, keys: tuple[str, ...]) -> dict:
    """Items of a trainer checkpoint's state as host numpy arrays (nothing else is read)."""
    import orbax.checkpoint as ocp

    checkpointer = ocp.PyTreeCheckpointer()
    saved = checkpointer.metadata(state_dir(step_dir)).item_metadata
    missing = [key for key in keys if saved.get(key) is None]
    if missing:
        raise ValueError(f"checkpoint {step_dir} holds no {', '.join(missing)}: not a LoRA trainer's checkpoint")
    target = {key: jax.tree.map(lambda m: np.empty(m.shape, m.dtype), dict(saved[key])) for key in keys}
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), target)
    return checkpointer.restore(state_dir(step_dir), args=ocp.args.PyTreeRestore(
        target, restore_args=restore_args, partial_restore=True))


@dataclasses.dataclass(frozen=True)
class LoraRun:
    """A LoRA run's checkpoint, checked against its base (lora_run): the settings, the model, the base's newest
    step directory, and the checkpoint's trained params and base checksums (host numpy: adapters, small)."""

    config: lora.LoraConfig
    model_config: ModelConfig
    step_dir: Path
    init_from: str
    base_step: Path
    base_what: str
    saved: dict

    def check_base(self, base_checksums: dict) -> None:
        """Refuse a base whose checksums (lora.checksums) differ from those the checkpoint was saved with."""
        lora.check_same_base(self.saved[BASE_CHECKSUMS], base_checksums, self.step_dir, self.init_from,
                             "the adapters fit the base they were trained on only")


def lora_run(path: str | Path, *, what: str = "checkpoint") -> LoraRun | None:
    """The LoRA run directory / checkpoint at `path` (its newest intact one), its base resolved and its model
    compared with the base's; None when `path` is not a LoRA run. Reads no base weights."""
    from diffjax.config import RUNTIME_FIELDS

    step_dir = resolve_checkpoint(path, what)
    run = RunDir.of_step(step_dir)
    settings = lora.run_settings(run.config_file)
    if settings is None:
        return None
    config, init_from = settings
    model_config = saved_model_config(step_dir, what=what)
    base_what = f"{run.config_file}'s train.init_from (the LoRA run's base)"
    base_step = resolve_checkpoint(init_from, base_what)
    base_config = saved_model_config(base_step, what=base_what)
    differing = [f.name for f in dataclasses.fields(ModelConfig) if f.init and f.name not in RUNTIME_FIELDS
                 and getattr(base_config, f.name) != getattr(model_config, f.name)]
    if differing:
        raise ValueError(f"the LoRA run {run.path} and its base {base_step} (train.init_from) are different models "
                         f"(model.{', model.'.join(differing)} differ)")
    saved = _read_state_items(step_dir, (PARAMS, BASE_CHECKSUMS))
    return LoraRun(config, model_config, step_dir, init_from, base_step, base_what, saved)


def merged_lora_params(path: str | Path, *, what: str = "checkpoint") -> tuple[dict, ModelConfig, Path] | None:
    """(the merged params as a nested dict of numpy arrays, the ModelConfig, the first non-LoRA base's step
    directory) of a LoRA run directory / checkpoint (its newest intact one): the base (train.init_from, itself
    possibly a LoRA run) with the trained base params put back and the adapters merged (diffjax.lora.model_params).
    Refuses a base that changed since the checkpoint was saved. None when `path` is not a LoRA run. Holds the whole
    base in memory (diffjax.convert.lora_merge.LazyMergedParams reads it one leaf at a time)."""
    run = lora_run(path, what=what)
    if run is None:
        return None
    nested_run = merged_lora_params(run.base_step, what=run.base_what)
    base = nested_run[0] if nested_run is not None else load_params(run.base_step, what=run.base_what)
    run.check_base(jax.device_get(jax.jit(lora.checksums)(base)))
    merged = lora.model_params(run.saved[PARAMS], base, run.config)
    root_step = nested_run[2] if nested_run is not None else run.base_step  # (whose hf/ files an export keeps)
    return jax.tree.map(np.asarray, merged), run.model_config, root_step


def load_model_params(path: str | Path, abstract_params: Any, *, what: str = "checkpoint") -> Any:
    """load_params, except that a LoRA run gives its merged params (merged_lora_params), placed like
    `abstract_params`: what a model runs with (load_model, train.init_from)."""
    step_dir = resolve_checkpoint(path, what)  # (once: a damaged newer checkpoint is reported once)
    merged = merged_lora_params(step_dir, what=what)
    if merged is None:
        return load_params(step_dir, abstract_params, what=what)
    check_same_params(merged[0], abstract_params, f"{what}: the LoRA run {path} (merged) does not match this model")
    return jax.tree.map(lambda x, t: jax.device_put(x.astype(t.dtype), t.sharding), merged[0], abstract_params)


class CheckpointParams(Mapping):
    """The params of a diffjax checkpoint (trainer-written or converted) as a read-only mapping
    {path: numpy array} that reads one array from disk per access and keeps nothing: an export
    then holds one stacked leaf at a time instead of the whole model. Per-layer checkpoints show
    the stacked paths (each access reads and stacks the layers' arrays)."""

    def __init__(self, step_dir: str | os.PathLike):
        import orbax.checkpoint as ocp

        self._directory = state_dir(step_dir)
        self._checkpointer = ocp.PyTreeCheckpointer()
        saved = self._checkpointer.metadata(self._directory).item_metadata.get(PARAMS)
        if saved is None:
            raise ValueError(f"checkpoint {step_dir} holds no params")
        per_layer = is_per_layer(saved)
        self._stored, self.shapes, self.dtypes = {}, {}, {}  # path -> the stored key paths it is read from
        for key_path, meta in jax.tree_util.tree_leaves_with_path(saved):
            stored = tuple(str(getattr(k, "key", k)) for k in key_path)
            path, shape = stored, tuple(meta.shape)
            if per_layer and stored[0] == FIRST_SEGMENT:
                path = (FIRST_SEGMENT,) + stored[2:]
                shape = (len(saved[FIRST_SEGMENT]),) + shape
            self._stored.setdefault(path, []).append(stored)
            self.shapes[path], self.dtypes[path] = shape, np.dtype(meta.dtype)
        for stored in self._stored.values():
            stored.sort(key=lambda keys: int(keys[1]) if per_layer and keys[0] == FIRST_SEGMENT else 0)

    def _read(self, stored: tuple[str, ...], shape, dtype) -> np.ndarray:
        import orbax.checkpoint as ocp

        item = np.empty(shape, dtype)
        for key in reversed(stored):
            item = {key: item}
        restore_args = {PARAMS: _map_leaves(item, lambda _: ocp.RestoreArgs(restore_type=np.ndarray))}
        restored = self._checkpointer.restore(
            self._directory, args=ocp.args.PyTreeRestore({PARAMS: item}, restore_args=restore_args, partial_restore=True)
        )[PARAMS]
        for key in stored:
            restored = restored[key]
        return restored

    def _per_layer(self, path) -> bool:
        stored = self._stored[path]
        return len(stored) > 1 or len(stored[0]) > len(path)

    def __getitem__(self, path) -> np.ndarray:
        stored = self._stored[path]
        if not self._per_layer(path):
            return self._read(stored[0], self.shapes[path], self.dtypes[path])
        return np.stack([self._read(keys, self.shapes[path][1:], self.dtypes[path]) for keys in stored])

    def layer(self, path, depth: int) -> np.ndarray:
        """Layer `depth` of the stacked leaf `path`, reading only the chunks that hold it (an export then
        holds one layer's tensor, not a whole stack). Orbax restores whole arrays, so this opens the array
        with tensorstore, Orbax's storage layer: a zarr array per parameter, in an OCDBT store when the
        trainer wrote it."""
        import tensorstore as ts

        stored = self._stored[path]
        if self._per_layer(path):
            return self._read(stored[depth], self.shapes[path][1:], self.dtypes[path])
        name = ".".join((PARAMS,) + stored[0])
        if (self._directory / "manifest.ocdbt").exists():
            kvstore = {"driver": "ocdbt", "base": f"file://{self._directory}", "path": name}
        else:
            kvstore = {"driver": "file", "path": str(self._directory / name)}
        array = ts.open({"driver": "zarr", "kvstore": kvstore}, open=True, read=True).result()
        return np.asarray(array[depth].read().result(), self.dtypes[path])

    def __iter__(self):
        return iter(self._stored)

    def __len__(self) -> int:
        return len(self._stored)


def _map_leaves(tree, fn):
    return {k: _map_leaves(v, fn) for k, v in tree.items()} if isinstance(tree, dict) else fn(tree)
