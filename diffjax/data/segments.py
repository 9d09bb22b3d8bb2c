"""Documents whose loss counts only some of their text: a jsonl line {"segments": [{"text": ..., "label": bool}]}
(axolotl's template-free format). Each segment is tokenized on its own and the pieces concatenated, so a segment's
tokens never merge with its neighbours'; the loss counts the tokens of the segments labelled true (and the eos
when the last one is). Prompts and instructions go in unlabelled segments, answers in labelled ones.

A plain string document is one labelled segment: every token counts, as before.
"""

from __future__ import annotations

import json
from typing import Callable, Union

import numpy as np

Segments = tuple[tuple[str, bool], ...]  # (text, counted in the loss)
Document = Union[str, Segments]


def parse_segments(value, fail: Callable[[str], None]) -> Segments:
    """A "segments" field -> Segments; fail(message) on anything but a list of {"text": str, "label": bool}."""
    if not isinstance(value, list):
        fail(f"field 'segments' must be a list of {{'text': str, 'label': bool}}, got {type(value).__name__}")
    segments = []
    for i, segment in enumerate(value):
        if not (isinstance(segment, dict) and set(segment) == {"text", "label"} and isinstance(segment["text"], str)
                and isinstance(segment["label"], bool)):
            fail(f"segments[{i}] must be {{'text': str, 'label': bool}}, got {segment!r:.120}")
        segments.append((segment["text"], segment["label"]))
    return tuple(segments)


def to_json_line(document: Document) -> str:
    """One jsonl line the jsonl source reads back as `document`."""
    if isinstance(document, str):
        return json.dumps({"text": document})
    return json.dumps({"segments": [{"text": text, "label": label} for text, label in document]})


def tokenize_document(tokenizer, document: Document, eos_id: int | None) -> tuple[np.ndarray, np.ndarray]:
    """(tokens int32 [L], loss_mask int32 [L]): 1 where the token is a target the loss counts."""
    segments = ((document, True),) if isinstance(document, str) else document
    pieces = [np.asarray(tokenizer.encode(text), np.int32) for text, _ in segments]
    masks = [np.full(len(piece), int(label), np.int32) for piece, (_, label) in zip(pieces, segments)]
    if eos_id is not None and segments:
        pieces.append(np.array([eos_id], np.int32))
        masks.append(np.array([int(segments[-1][1])], np.int32))
    if not pieces:
        return np.zeros(0, np.int32), np.zeros(0, np.int32)
    return np.concatenate(pieces), np.concatenate(masks)
