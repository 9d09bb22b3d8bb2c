"""Training data: document sources, the train / eval split, and grain packing pipelines.

    source = open_documents(data_config)                       # len(source), source[i] -> str
    train = make_train_dataset(data_config, tokenizer, batch_size=B, seed=S)
    it = iter(train); batch = next(it)                          # tokens / segment_ids / positions [B, T]
    state = it.get_state(); ...; it.set_state(state)            # JSON-serialisable, exact resume
    eval_batches = make_eval_batches(data_config, tokenizer, batch_size=B)
"""

from diffjax.data.builtin import (
    DEFAULT_CORPUS_BYTES,
    builtin_documents,
    builtin_held_out,
    stdlib_source_files,
)
from diffjax.data.pipeline import BATCH_KEYS, make_eval_batches, make_train_dataset, pack_documents
from diffjax.data.sources import JsonlSource, ListSource, ParquetSource, TextFileSource, expand_paths, open_documents
from diffjax.data.split import is_eval_document, split_documents

__all__ = [
    "BATCH_KEYS",
    "DEFAULT_CORPUS_BYTES",
    "JsonlSource",
    "ListSource",
    "ParquetSource",
    "TextFileSource",
    "builtin_documents",
    "builtin_held_out",
    "expand_paths",
    "is_eval_document",
    "make_eval_batches",
    "make_train_dataset",
    "open_documents",
    "pack_documents",
    "split_documents",
    "stdlib_source_files",
]
