"""Train / eval split of documents by a fixed hash of the document index.

A document is held out when the hash of its index, as a fraction of 2^64, falls below
eval_fraction. The choice depends on nothing else (not the seed, the shuffle or the number of
processes), so the eval set is the same in every run over the same source, and raising
eval_fraction only moves documents from train to eval. A stream's documents have no fixed index
(its order changes with the shuffle): they are split by a hash of their text (`is_eval_text`).
"""

from __future__ import annotations

import hashlib

import numpy as np

_SALT = np.uint64(0x6469666A6178)  # "diffjax": keeps this split unrelated to other index hashes


def _splitmix64(x_N: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser: a fixed bijection of uint64 that scatters neighbouring indices."""
    z = x_N.astype(np.uint64) + _SALT
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def is_eval_document(num_documents: int, eval_fraction: float) -> np.ndarray:
    """Bool [num_documents]: True for the held-out documents."""
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction!r}")
    with np.errstate(over="ignore"):
        hashes = _splitmix64(np.arange(num_documents, dtype=np.uint64))
    # The top 53 bits as a float in [0, 1): exact, so the comparison is the same on every machine.
    return (hashes >> np.uint64(11)).astype(np.float64) * 2.0**-53 < eval_fraction


def split_documents(num_documents: int, eval_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train_indices, eval_indices): int64 document indices in increasing order."""
    held_out = is_eval_document(num_documents, eval_fraction)
    return np.flatnonzero(~held_out), np.flatnonzero(held_out)


def is_eval_text(text: str, eval_fraction: float) -> bool:
    """Whether a streamed document is held out: the top 53 bits of its text's BLAKE2b hash as a fraction of 1."""
    digest = int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big")
    return (digest >> 11) * 2.0**-53 < eval_fraction
