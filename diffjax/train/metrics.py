"""Training metrics: an analytic FLOP count, MFU, and JSONL / TensorBoard writers (the model's kinds add their own
through their facets: diffjax.model.facets).

FLOP convention (per trained token, multiply-add = 2 FLOPs, training = 3 x forward):
  dense:     6 x (every matmul parameter: q, k, v, o, the MLP and the LM head; not the embedding
             lookup, norms or lambda vectors)
  attention: 3 x forward score + value FLOPs with causal context T/2 (causal halves the T x T square;
             packing is not discounted; a layer with a sliding window W < T: W - W^2 / 2T). Per layer and token the forward pass costs
             DIFF:      H heads x 2 maps x (2 d ctx for q k^T + 2 (2d) ctx for p v) = 12 H d ctx
                        (Shared DIFF too)
             DIFF V2:   H heads x 2 maps x (2 d ctx + 2 d ctx) = 8 H d ctx
             standard:  N heads x (2 d ctx + 2 d ctx) = 4 N d ctx
  so DIFF attention with H = N / 2 costs 1.5x the baseline's (its value dim is 2d for both maps), and V2 with
  H = N twice the baseline's.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from diffjax import attention_kinds, block_kinds, mlp_kinds, residual_kinds, storage
from diffjax.kinds import param_stacks
from diffjax.config import ModelConfig
from diffjax.run_dir import RunDir

# Dense bf16 peak FLOP/s per device (vendor figures, no sparsity), matched against jax's device_kind.
PEAK_FLOPS = (
    ("H200", 989e12),
    ("H100", 989e12),
    ("A100", 312e12),
    ("L4", 121e12),
    ("TPU v6", 918e12),
    ("TPU v5p", 459e12),
    ("TPU v5 lite", 197e12),
    ("TPU v5e", 197e12),
    ("TPU v4", 275e12),
)


def matmul_params(config: ModelConfig) -> int:
    """Parameters that take part in a matmul per token (the LM head counts even when tied; a mixture of experts
    counts the experts a token is routed to: the MLP kind's matmul_params): every stack's layers (diffjax.kinds.
    param_stacks), each with what its block kind adds (diffjax.block_kinds: a layer with logits of its own counts the
    LM head once more), and the LM head."""
    def per_layer(c: ModelConfig) -> int:
        attention = attention_kinds.get(c.attention)
        return (attention.attention_params(c) - attention.vector_params(c) + mlp_kinds.get(c.mlp).matmul_params(c)
                + residual_kinds.get(c.residual).matmul_params(c))

    return config.d_model * config.vocab_size + sum(
        segment.num_layers * (per_layer(segment.config) + block_kinds.get(segment.block).matmul_params(config))
        for segment in param_stacks(config))


def training_flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """Forward + backward FLOPs per token (module docstring); each stack's layers attend with its own config (a
    stack that follows the layers is windowed at every position when the model has a window)."""
    attention_forward = sum(attention_kinds.get(segment.config.attention).attention_flops(
        segment.config, segment.config.mean_context(depth, seq_len))
        for segment in param_stacks(config) for depth in range(segment.start, segment.stop))
    return 6 * matmul_params(config) + 3 * attention_forward


def peak_flops_per_device(device_kind: str, override_tflops: float | None = None) -> float | None:
    if override_tflops is not None:
        return override_tflops * 1e12
    for name, flops in PEAK_FLOPS:
        if name.lower() in device_kind.lower():
            return flops
    return None


def read_records(path: Path) -> list[dict]:
    """The records of a metrics.jsonl ([] when there is none); a line cut short by a crash is skipped."""
    records, path = [], storage.as_path(path)
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def _free_name(path: Path) -> Path:
    n = 1
    while path.with_name(f"{path.name}.{n}").exists():
        n += 1
    return path.with_name(f"{path.name}.{n}")


class _ObjectAppender:
    """Appends to a gs:// object, which cannot be appended to: rewritten whole by `flush`, at most every
    UPLOAD_SECONDS unless forced (before each checkpoint and at the end: what a resume keeps is never lost)."""

    UPLOAD_SECONDS = 30

    def __init__(self, path):
        self.path = path
        self._text = path.read_text() if path.exists() else ""
        self._uploaded, self._last = len(self._text), 0.0

    def write(self, line: str) -> None:
        self._text += line

    def flush(self, force: bool = False) -> None:
        if len(self._text) == self._uploaded or not (force or time.monotonic() - self._last >= self.UPLOAD_SECONDS):
            return
        self.path.write_text(self._text)
        self._uploaded, self._last = len(self._text), time.monotonic()

    def close(self) -> None:
        self.flush(force=True)


class _EventsUploader:
    """TensorBoard events of a gs:// run: written to a local staging directory and copied up (each file whole, as
    an object store takes them) every UPLOAD_SECONDS and at the end. (tensorboardX's own gs:// writer uploads again
    when collected, at interpreter exit: a 120 s hang where the bucket is no longer reachable.)"""

    UPLOAD_SECONDS = 30

    def __init__(self, target):
        self.target, self.staging = target, Path(tempfile.mkdtemp(prefix="diffjax-tensorboard-"))
        self._last = 0.0

    def upload(self, writer, final: bool = False) -> None:
        if not final and time.monotonic() - self._last < self.UPLOAD_SECONDS:
            return
        if writer is not None:
            writer.flush()
        storage.copy_tree(self.staging, self.target)
        self._last = time.monotonic()
        if final:
            shutil.rmtree(self.staging, ignore_errors=True)


class MetricsWriteError(RuntimeError):
    """metrics.jsonl or the TensorBoard events could not be written (a full disk, most often): the run stops like
    a failed save (train.py: one line, exit status 1); the checkpoints are intact and a rerun resumes."""


class _EventsFile:
    """The file tensorboardX's writer thread writes events into, keeping the first OSError for MetricsWriter to
    raise in the training thread. Raised in that thread, it printed a traceback and ended the thread, and the
    run then hung once the thread's queue (10 events) was full."""

    def __init__(self, file):
        self.file, self.error = file, None

    def _guarded(self, operation) -> None:
        if self.error is None:
            try:
                operation()
            except OSError as error:
                self.error = error

    def write(self, data: bytes) -> None:
        self._guarded(lambda: self.file.write(data))

    def flush(self) -> None:  # (no fileno: tensorboardX's fsync would run unguarded)
        self._guarded(lambda: (self.file.flush(), os.fsync(self.file.fileno())))

    def close(self) -> None:  # (a buffered file closes its descriptor even when the flush before fails)
        try:
            self.file.close()
        except OSError as error:
            self.error = self.error or error


def _summary_writer_class():
    """tensorboardX's SummaryWriter, imported with torch hidden unless torch is loaded already: tensorboardX's writer
    module imports torch wherever it is installed (1.4 s of every trainer start) only for type hints of the torch
    tensors it would accept; the trainer logs floats and numpy arrays."""
    import sys

    if "torch" in sys.modules or "tensorboardX" in sys.modules:
        from tensorboardX import SummaryWriter

        return SummaryWriter
    sys.modules["torch"] = None  # `import torch` raises ImportError while tensorboardX loads
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


def _guard_events_file(writer) -> _EventsFile:
    """Puts an _EventsFile between a tensorboardX SummaryWriter (2.6) and its open event file."""
    try:
        records = writer._get_file_writer().event_writer._ev_writer._py_recordio_writer
    except AttributeError:  # another tensorboardX: its thread's errors are its own again (a test says so)
        return _EventsFile(None)
    records._writer = _EventsFile(records._writer)
    return records._writer


class MetricsWriter:
    """Appends records to <run_dir>/metrics.jsonl and, optionally, TensorBoard event files.

    On resume from `resume_step`, records of later steps (written after the last checkpoint by
    a run that then died) are dropped from the JSONL and TensorBoard purges them too. Nothing is deleted
    to start over: a run starting at step 0 beside the records of an earlier start keeps them as
    metrics.jsonl.1 (.2, ...), and TensorBoard hides the earlier events from step 1 on (they stay on disk).
    """

    def __init__(self, run: RunDir, *, tensorboard: bool, resume_step: int = 0, enabled: bool = True):
        self.enabled = enabled  # False on all but the main process of a multi-process run
        self.kept_as = None  # where the records of an earlier start went
        if not enabled:
            return
        self.jsonl_path = run.metrics_file
        if resume_step and self.jsonl_path.exists():
            self._truncate_after(resume_step)
        elif not resume_step and read_records(self.jsonl_path):
            self.kept_as = _free_name(self.jsonl_path)
            storage.move(self.jsonl_path, self.kept_as)
        self._jsonl = _ObjectAppender(self.jsonl_path) if storage.is_url(self.jsonl_path) else open(self.jsonl_path, "a", buffering=1)
        self._tensorboard = None
        if tensorboard:
            SummaryWriter = _summary_writer_class()
            earlier = run.tensorboard.is_dir() and any(run.tensorboard.iterdir())
            self._uploader = _EventsUploader(run.tensorboard) if storage.is_url(run.tensorboard) else None
            self._tensorboard = SummaryWriter(str(self._uploader.staging if self._uploader else run.tensorboard),
                                              purge_step=resume_step + 1 if resume_step or earlier else None)
            self._events, self._events_dir = _guard_events_file(self._tensorboard), run.tensorboard
        self.failed = False  # a write failed: its MetricsWriteError was raised once

    def _truncate_after(self, step: int):
        kept = [record for record in read_records(self.jsonl_path) if record.get("step", 0) <= step]
        try:  # a kill while rewriting must not lose the file
            storage.write_text_atomically(self.jsonl_path, "".join(json.dumps(record) + "\n" for record in kept))
        except OSError as error:  # a full disk, most often: the file stays as it was, no stub is left
            raise OSError(f"could not rewrite {self.jsonl_path} past step {step} ({error.strerror}); "
                          "it is unchanged: free some space and rerun") from None

    def write(self, step: int, kind: str, values: dict[str, float], histograms: dict | None = None):
        """Appends a record of `values`; `histograms` (name: array) go to TensorBoard only."""
        if not self.enabled:
            return
        clean = {key: (float(v) if v is not None and math.isfinite(float(v)) else None) for key, v in values.items()}
        try:
            self._jsonl.write(json.dumps({"step": step, "kind": kind, **clean}) + "\n")
        except OSError as error:
            raise self._failure(f"of step {step} to {self.jsonl_path}", error) from None
        if self._tensorboard is not None:
            for key, value in clean.items():
                if value is not None:
                    self._tensorboard.add_scalar(f"{kind}/{key}", value, step)
            for key, array in (histograms or {}).items():
                self._tensorboard.add_histogram(f"{kind}/{key}", np.asarray(array), step)
            if self._uploader is not None:
                self._uploader.upload(self._tensorboard)
            if self._events.error is not None:  # met by tensorboardX's thread, at this step or an earlier one
                raise self._failure(f"by step {step} to {self._events_dir}", self._events.error)

    def _failure(self, what: str, error: OSError) -> MetricsWriteError:
        self.failed = True
        return MetricsWriteError(f"could not write the metrics {what} ({error.strerror or error}); the checkpoints "
                                 "saved so far are intact: free some space and rerun to resume")

    def flush(self, force: bool = False):
        """metrics.jsonl on gs:// uploaded (throttled unless `force`); a local file is written line by line."""
        if self.enabled and isinstance(self._jsonl, _ObjectAppender):
            self._jsonl.flush(force)

    def close(self, report: bool = True):
        """Closes the files; a write that fails now raises MetricsWriteError when `report` (not while another
        error stops the run) and unless one was raised already."""
        if not self.enabled:
            return
        failure = None
        try:
            self._jsonl.close()
        except OSError as error:
            failure = (f"to {self.jsonl_path}", error)
        if self._tensorboard is not None:
            self._tensorboard.close()
            if self._events.error is not None:
                failure = failure or (f"to {self._events_dir}", self._events.error)
            elif self._uploader is not None:
                self._uploader.upload(None, final=True)
        if failure and report and not self.failed:
            raise self._failure(*failure)
