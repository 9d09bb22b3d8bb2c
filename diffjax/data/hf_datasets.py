"""data.source "hf": a Hugging Face dataset read through the `datasets` library (the hub extra), as transformers,
MaxText and Levanter users name their data: `data.hf_dataset=org/name` (data.hf_config, data.hf_split,
data.hf_revision, data.text_field), by index from the prepared dataset (`HFDatasetSource`: the pipeline's exact
shuffles and resume, as for files) or streamed (`DocumentStream`, data.hf_streaming: diffjax.data.stream).

Where a dataset is read from: a local directory as it is; a Hub name through `datasets.load_dataset` online (streamed,
or downloaded and prepared once in datasets' cache); offline (HF_HUB_OFFLINE) or when the Hub does not answer, from
the Hugging Face cache: the Hub cache's snapshot of the dataset repository (`hf download NAME --repo-type dataset`,
found by diffjax.convert.hub, which datasets itself does not read offline), else datasets' own cache of an earlier
load. Anything missing is one line naming the data.hf_* key and what to do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

from diffjax.convert import hub
from diffjax.data.config import DataConfig
from diffjax.log_lines import first_line

SHUFFLE_BUFFER = 1000  # documents in datasets' shuffle buffer of a stream (with its shards' order, per epoch)


def load(config: DataConfig):
    """config.hf_split of config.hf_dataset: a datasets.Dataset, or an IterableDataset with data.hf_streaming."""
    name, revision = config.hf_dataset, config.hf_revision
    if Path(name).expanduser().exists() or not hub.is_hub_name(name):
        if revision is not None:
            raise ValueError(f"data.hf_revision {revision!r} applies to a Hub dataset name (org/name), and data."
                             f"hf_dataset {name!r} is {'a local path' if Path(name).expanduser().exists() else 'not one'}")
        return _load(str(Path(name).expanduser()), config, revision=None)
    unreachable = None
    if not hub.is_offline():
        try:
            return _load(name, config, revision=revision)
        except ConnectionError as error:  # the Hub did not answer (datasets looked in its own cache already)
            unreachable = error
    snapshot = hub.cached_snapshot(name, revision=revision)
    if snapshot is not None:
        return _load(str(snapshot), config, revision=None)
    if unreachable is None:
        try:
            return _load(name, config, revision=revision)  # offline: datasets' own cache of an earlier load
        except ConnectionError:
            pass
    why = (hub.offline_because(hub.OFFLINE_VARIABLES) if unreachable is None else
           f"the Hub could not be reached ({first_line(unreachable)})")
    raise FileNotFoundError(f"data.hf_dataset {hub.described(name, revision)} is not a local directory and is not in "
                            f"the Hugging Face cache (Hub snapshots: {hub.hub_cache()}; prepared datasets: "
                            f"{_datasets_cache()}), and {why}; {hub.fetch_hint(name, revision, repo_type='dataset')}")


def _load(path: str, config: DataConfig, *, revision: str | None):
    """datasets.load_dataset, its errors about the dataset as one line naming the data key (ConnectionError passes)."""
    datasets = _datasets()
    try:
        return datasets.load_dataset(path, config.hf_config, split=config.hf_split, streaming=config.hf_streaming,
                                     revision=revision)
    except ConnectionError:
        raise
    except ValueError as error:
        text = first_line(error)
        key = ("hf_split" if "split" in text.lower() else
               "hf_config" if "config" in text.lower() else "hf_dataset")
        raise ValueError(f"data.{key} {getattr(config, key)!r}: {text}") from None
    except FileNotFoundError as error:  # datasets' DatasetNotFoundError, data files that are not there
        raise FileNotFoundError(f"data.hf_dataset {config.hf_dataset!r}: {first_line(error)}") from None


def _datasets():
    try:
        import datasets
    except ImportError:
        raise ImportError("data.source 'hf' reads through the datasets package: pip install 'diffjax[hub]'") from None
    return datasets


def _datasets_cache() -> str:
    return str(_datasets().config.HF_DATASETS_CACHE)


def _text(record: dict, config: DataConfig, where: str) -> str:
    """A record's document: its config.text_field string ("" for a null)."""
    if config.text_field not in record:
        raise ValueError(f"data.hf_dataset {config.hf_dataset!r}: no column {config.text_field!r} (columns: "
                         f"{sorted(record)}); set data.text_field")
    text = record[config.text_field]
    if text is not None and not isinstance(text, str):
        raise ValueError(f"data.hf_dataset {config.hf_dataset!r} {where}: column {config.text_field!r} must hold "
                         f"strings, got {type(text).__name__}")
    return text or ""


class HFDatasetSource:
    """One row of a prepared (Arrow, memory-mapped) dataset = one document, read by index: a random-access source
    like the file sources (pickles for grain's workers by its Arrow files)."""

    def __init__(self, config: DataConfig, dataset=None):
        dataset = load(config) if dataset is None else dataset
        if config.text_field not in dataset.column_names:
            raise ValueError(f"data.hf_dataset {config.hf_dataset!r}: no column {config.text_field!r} (columns: "
                             f"{dataset.column_names}); set data.text_field")
        self.config, self._dataset = config, dataset.select_columns([config.text_field])

    def __len__(self) -> int:
        return len(self._dataset)

    def __getitem__(self, index: int) -> str:
        index = int(index)
        if not -len(self) <= index < len(self):
            raise IndexError(f"document index {index} out of range [0, {len(self)})")
        return _text(self._dataset[index], self.config, f"row {index % len(self)}")

    def __repr__(self) -> str:
        return f"HFDatasetSource({len(self)} documents of {self.config.hf_dataset}, split {self.config.hf_split})"


class DocumentStream:
    """A streamed dataset's documents in order (data.hf_streaming): no len, no random access. `documents(seed,
    epoch, skip)` is one epoch's stream, shuffled (shards and a buffer of SHUFFLE_BUFFER documents) by seed + epoch
    unless seed is None, from document `skip` on: the same call gives the same documents (diffjax.data.stream resumes
    by it)."""

    def __init__(self, config: DataConfig):
        self.config, self._stream = config, load(config)

    def documents(self, *, seed: int | None = None, epoch: int = 0, skip: int = 0) -> Iterator[str]:
        stream = self._stream
        if seed is not None:
            stream = stream.shuffle(seed=(seed + epoch) % 2**32, buffer_size=SHUFFLE_BUFFER)
        for position, record in enumerate(stream.skip(skip) if skip else stream, start=skip):
            yield _text(record, self.config, f"document {position} of the stream")

    def __iter__(self) -> Iterator[str]:
        return self.documents()

    def __repr__(self) -> str:
        return f"DocumentStream({self.config.hf_dataset}, split {self.config.hf_split})"
