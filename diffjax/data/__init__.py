"""Training data: document sources, the train / eval split, and grain packing pipelines.

    source = open_documents(data_config)                       # len(source), source[i] -> str
    train = make_train_dataset(data_config, tokenizer, batch_size=B, seed=S)
    it = iter(train); batch = next(it)                          # tokens / segment_ids / positions [B, T]
    state = it.get_state(); ...; it.set_state(state)            # JSON-serialisable, exact resume
    eval_batches = make_eval_batches(data_config, tokenizer, batch_size=B)
"""

from diffjax.lazy_exports import lazy_exports

# The names load on first use, so that the run config's DataConfig (diffjax.data.config) loads no grain or jax.
_EXPORTS = {
    **dict.fromkeys(("DEFAULT_CORPUS_BYTES", "builtin_documents", "builtin_held_out", "stdlib_source_files"),
                    "diffjax.data.builtin"),
    **dict.fromkeys(("BATCH_KEYS", "make_eval_batches", "make_train_dataset", "pack_documents"),
                    "diffjax.data.pipeline"),
    **dict.fromkeys(("JsonlSource", "ListSource", "ParquetSource", "TextFileSource", "expand_paths", "open_documents"),
                    "diffjax.data.sources"),
    **dict.fromkeys(("is_eval_document", "split_documents"), "diffjax.data.split"),
}


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())


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
