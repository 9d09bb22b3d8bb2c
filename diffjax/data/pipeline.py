"""grain pipelines: documents -> tokens -> pieces of at most seq_len -> packed rows -> batches.

    train document indices --shard by process--> shuffle per epoch (seed) --> repeat forever
      --> tokenize (+ eos) --> split into seq_len pieces --> first-fit pack
      --> shuffle rows within a window (seed) --> batch

Every stage before packing is random-access (grain MapDataset), so the iterator's state is a few
integers: where the index stream stands, how far into the current document's pieces, which row
of the current pack and of the current shuffle window comes next. Packing is re-done from those on
restore, which makes
`it.set_state(state)` continue exactly, in this process or a fresh one. A streamed source
(data.hf_streaming) replaces the index stages by diffjax.data.stream, whose state is (epoch, documents
read): the same stages follow it and resume as exactly.

Batches are dicts of int32 arrays [batch_size, seq_len]:
  tokens       token ids (0 in padding)
  segment_ids  1, 2, ... for the documents (or pieces of a long document) in a row; 0 = padding
  positions    0, 1, ... restarting at every segment (0 in padding)
  loss_mask    1 where the token is a target the loss counts: every token of a text document, the labelled
               segments' of a segments document (diffjax.data.segments); 0 in padding
Pass positions and segment_ids to TransformerLM so attention never crosses documents, and train
with diffjax.losses.packed_next_token_loss so no target crosses a document or lands in padding.
"""

from __future__ import annotations

import grain
import numpy as np

from diffjax.data import stream
from diffjax.data.config import DataConfig
from diffjax.data.segments import tokenize_document
from diffjax.data.sources import open_documents
from diffjax.data.split import split_documents

BATCH_KEYS = ("tokens", "segment_ids", "positions", "loss_mask")

class _TokenizeDocument(grain.transforms.Map):
    """Document index -> list of {"tokens", "loss_mask": int32 [<= seq_len]}: the document's tokens (+ eos) in pieces.

    A document longer than seq_len becomes several pieces, each packed as its own segment; an empty
    document (with no eos) becomes none.
    """

    def __init__(self, source, tokenizer, seq_len: int, eos_id: int | None):
        self.source, self.tokenizer, self.seq_len, self.eos_id = source, tokenizer, seq_len, eos_id

    def map(self, document_index):
        return self.pieces(self.source[int(document_index)])

    def pieces(self, document) -> list[dict]:
        tokens, loss_mask = tokenize_document(self.tokenizer, document, self.eos_id)
        return [{"tokens": tokens[start : start + self.seq_len], "loss_mask": loss_mask[start : start + self.seq_len]}
                for start in range(0, len(tokens), self.seq_len)]


class _TokenizeStreamed(_TokenizeDocument):
    """A streamed document (its text, not an index) -> its pieces."""

    def map(self, document):
        return self.pieces(document)


class _Pieces(grain.experimental.FlatMapTransform):
    """Flattens the lists of pieces. (max_fan_out only matters for MapDataset flat maps; not used.)"""

    max_fan_out = 1

    def flat_map(self, pieces):
        return pieces


def _rename_packed(row: dict) -> dict:
    """grain names the packing features after the packed key; give them the batch names."""
    return {"tokens": row["tokens"], "segment_ids": row["tokens_segment_ids"], "positions": row["tokens_positions"],
            "loss_mask": row["loss_mask"]}


def _resolve_shard(shard_index: int | None, shard_count: int | None) -> tuple[int, int]:
    if shard_index is None or shard_count is None:
        import jax

        shard_index = jax.process_index() if shard_index is None else shard_index
        shard_count = jax.process_count() if shard_count is None else shard_count
    if not (isinstance(shard_count, int) and shard_count > 0 and isinstance(shard_index, int) and 0 <= shard_index < shard_count):
        raise ValueError(f"need 0 <= shard_index < shard_count, got shard_index={shard_index!r}, shard_count={shard_count!r}")
    return shard_index, shard_count


def _eos_id(config: DataConfig, tokenizer) -> int | None:
    return getattr(tokenizer, "eos_id", None) if config.append_eos else None


def pack_documents(source, document_indices, tokenizer, config: DataConfig, *, num_bins: int) -> grain.IterDataset:
    """Packed rows (dicts of int32 [config.seq_len]) of the documents source[i] for i in document_indices, in order.

    document_indices: a sequence or a grain.MapDataset of ints (finite or repeated). First-fit
    packing into num_bins rows at a time: each document (+ eos) goes, in pieces of at most seq_len,
    into the first row with room; when a piece fits nowhere the num_bins rows are emitted in order.
    """
    indices = document_indices if isinstance(document_indices, grain.MapDataset) else grain.MapDataset.source(document_indices)
    ds = indices.map(_TokenizeDocument(source, tokenizer, config.seq_len, _eos_id(config, tokenizer)))
    # Read and tokenize in the consuming thread: on few cores, grain's reader threads cost ~10x more
    # per document than they save. Parallelism comes from worker processes (data.worker_count).
    return _pack_pieces(ds.to_iter_dataset(grain.ReadOptions(num_threads=0)), config, num_bins)


def pack_stream(documents: grain.IterDataset, tokenizer, config: DataConfig, *, num_bins: int) -> grain.IterDataset:
    """pack_documents for streamed documents (diffjax.data.stream): packed rows of the texts `documents` yields."""
    ds = documents.map(_TokenizeStreamed(None, tokenizer, config.seq_len, _eos_id(config, tokenizer)))
    return _pack_pieces(ds, config, num_bins)


def _pack_pieces(ds: grain.IterDataset, config: DataConfig, num_bins: int) -> grain.IterDataset:
    """Each document's list of pieces -> first-fit packed rows with the batch keys' names."""
    ds = grain.experimental.FlatMapIterDataset(ds, _Pieces())
    ds = grain.experimental.FirstFitPackIterDataset(
        ds, length_struct={"tokens": config.seq_len, "loss_mask": config.seq_len}, num_packing_bins=num_bins, shuffle_bins=False
    )
    return ds.map(_rename_packed)


def _document_indices(config: DataConfig, source, split: str, shard_index: int, shard_count: int) -> grain.MapDataset:
    train_indices, eval_indices = split_documents(len(source), config.eval_fraction)
    indices = (train_indices if split == "train" else eval_indices)[shard_index::shard_count]
    return grain.MapDataset.source(indices)


def make_train_dataset(
    config: DataConfig,
    tokenizer,
    *,
    batch_size: int,
    seed: int,
    shard_index: int | None = None,
    shard_count: int | None = None,
    source=None,
) -> grain.IterDataset:
    """Endless packed training batches for this process (see the module docstring for the format).

    batch_size: rows per step on this process. seed: the run seed (document order per epoch and
    the order of rows within each pack). shard_index / shard_count default to jax.process_index()
    / jax.process_count(): process i reads train documents i, i + count, ... so processes see
    disjoint documents. source: an already opened document source (default open_documents(config)).

    `it = iter(dataset)`; `it.get_state()` is a small JSON-serialisable dict and
    `it.set_state(state)` (on an iterator of an identically built dataset) continues exactly.
    """
    if not (isinstance(batch_size, int) and batch_size > 0):
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if not (isinstance(seed, int) and seed >= 0):
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
    shard_index, shard_count = _resolve_shard(shard_index, shard_count)
    source = open_documents(config) if source is None else source
    seed = seed % 2**32  # grain's shuffle seeds are uint32
    if config.streams:
        documents = stream.train_documents(source, config, seed=seed, shard_index=shard_index, shard_count=shard_count)
        ds = pack_stream(documents, tokenizer, config, num_bins=batch_size)
    else:
        indices = _document_indices(config, source, "train", shard_index, shard_count)
        if len(indices) == 0:
            raise ValueError(
                f"process shard {shard_index} of {shard_count} has no training documents: the source has "
                f"{len(source)} documents and data.eval_fraction={config.eval_fraction} holds some out"
            )
        if config.shuffle:
            indices = indices.shuffle(seed)  # each epoch of the repeat below reshuffles (seed + epoch)
        ds = pack_documents(source, indices.repeat(), tokenizer, config, num_bins=batch_size)
    if config.shuffle:
        window_rows = max(batch_size, config.shuffle_window_tokens // config.seq_len)
        ds = grain.experimental.WindowShuffleIterDataset(ds, window_size=window_rows, seed=seed)
    ds = ds.batch(batch_size, drop_remainder=True)
    if config.worker_count > 0:
        _parse_absl_flags_for_grain()
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=config.worker_count))
    return ds


def _parse_absl_flags_for_grain():
    """grain's worker processes read an absl flag and fail when no absl.app parsed the command line
    (google/grain#1355); mark the flags parsed (at their defaults) when nothing else has."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def make_eval_batches(
    config: DataConfig,
    tokenizer,
    *,
    batch_size: int,
    shard_index: int | None = None,
    shard_count: int | None = None,
    source=None,
) -> list[dict]:
    """The first config.eval_batches packed batches of this process's held-out documents, in order.

    Fewer when the eval split is small, and [] when eval_fraction is 0 (or no document is held
    out). A last partial batch is filled with all-padding rows (segment_ids 0) so every batch has
    shape [batch_size, seq_len]. With several processes (shard_count > 1) the list is padded with
    all-padding batches to exactly config.eval_batches, so every process runs the same number of
    eval steps; padding rows count nothing in packed_next_token_loss.
    """
    if not (isinstance(batch_size, int) and batch_size > 0):
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    shard_index, shard_count = _resolve_shard(shard_index, shard_count)
    if config.eval_fraction == 0:
        return []
    source = open_documents(config) if source is None else source
    if config.streams:
        documents = stream.eval_documents(source, config, shard_index=shard_index, shard_count=shard_count)
        ds = pack_stream(documents, tokenizer, config, num_bins=batch_size)
    else:
        indices = _document_indices(config, source, "eval", shard_index, shard_count)
        ds = pack_documents(source, indices, tokenizer, config, num_bins=batch_size)
    batches = []
    for batch in ds.batch(batch_size, drop_remainder=False):
        if len(batches) == config.eval_batches:
            break
        batches.append({key: _pad_rows(batch[key], batch_size) for key in BATCH_KEYS})
    if shard_count > 1:
        empty = {key: np.zeros((batch_size, config.seq_len), np.int32) for key in BATCH_KEYS}
        batches += [empty] * (config.eval_batches - len(batches))
    return batches


def _pad_rows(array_BT: np.ndarray, batch_size: int) -> np.ndarray:
    missing = batch_size - array_BT.shape[0]
    return np.pad(array_BT, ((0, missing), (0, 0))) if missing else array_BT
