"""A stream of documents (diffjax.data.hf_datasets.DocumentStream, data.hf_streaming) as a grain IterDataset
whose iterator state is two integers, (epoch, documents read in it): `set_state` re-opens that epoch's stream (the
same shuffle: seed + epoch) and skips to where it stood, so the pipeline after it (tokenize, pack, shuffle rows,
batch: diffjax.data.pipeline) resumes exactly, as it does over random-access sources.

Which documents a reader keeps is a function of the document's place in the stream and its text: `train_documents`
keeps this process's share (every shard_count-th document, by place) of those whose text does not hash into the eval
split; `eval_documents` one pass over the unshuffled stream keeping the held-out ones.
"""

from __future__ import annotations

from typing import Callable

import grain

from diffjax.data.config import DataConfig
from diffjax.data.split import is_eval_text


class StreamDocuments(grain.IterDataset):
    """The documents of `stream` that `keep(place, text)` accepts, epoch after epoch (`repeat`) or one pass;
    shuffled by seed + epoch unless seed is None."""

    def __init__(self, stream, keep: Callable[[int, str], bool], *, seed: int | None, repeat: bool, what: str):
        super().__init__()
        self.stream, self.keep, self.seed, self.repeat, self.what = stream, keep, seed, repeat, what

    def __iter__(self) -> grain.DatasetIterator:
        return _StreamIterator(self)

    def __str__(self) -> str:
        return f"StreamDocuments({self.stream}, {self.what})"


class _StreamIterator(grain.DatasetIterator):
    def __init__(self, dataset: StreamDocuments):
        super().__init__()
        self._dataset = dataset
        self._epoch, self._place, self._documents = 0, 0, None
        self._kept_from_start = None  # documents kept this epoch when it was read from its start (None: resumed)

    def __next__(self) -> str:
        dataset = self._dataset
        while True:
            if self._documents is None:
                self._documents = dataset.stream.documents(seed=dataset.seed, epoch=self._epoch, skip=self._place)
                self._kept_from_start = 0 if self._place == 0 else None
            text = next(self._documents, None)
            if text is None:  # the epoch's end
                if self._kept_from_start == 0 and dataset.repeat:  # (an empty eval pass is no error)
                    raise ValueError(f"{dataset.stream}: no document of a whole pass is {dataset.what}")
                if not dataset.repeat:
                    raise StopIteration
                self._epoch, self._place, self._documents = self._epoch + 1, 0, None
                continue
            place, self._place = self._place, self._place + 1
            if dataset.keep(place, text):
                if self._kept_from_start is not None:
                    self._kept_from_start += 1
                return text

    def get_state(self) -> dict:
        return {"epoch": self._epoch, "place": self._place}

    def set_state(self, state: dict) -> None:
        self._epoch, self._place, self._documents = int(state["epoch"]), int(state["place"]), None


def train_documents(stream, config: DataConfig, *, seed: int, shard_index: int, shard_count: int) -> StreamDocuments:
    """This process's training documents of the stream, endlessly: reshuffled each epoch (data.shuffle)."""
    def keep(place: int, text: str) -> bool:
        return place % shard_count == shard_index and not is_eval_text(text, config.eval_fraction)

    return StreamDocuments(stream, keep, seed=seed if config.shuffle else None, repeat=True,
                           what=f"a training document of process shard {shard_index} of {shard_count}")


def eval_documents(stream, config: DataConfig, *, shard_index: int, shard_count: int) -> StreamDocuments:
    """This process's held-out documents of one unshuffled pass over the stream."""
    def keep(place: int, text: str) -> bool:
        return place % shard_count == shard_index and is_eval_text(text, config.eval_fraction)

    return StreamDocuments(stream, keep, seed=None, repeat=False, what="held out")
