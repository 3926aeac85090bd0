"""The spool: the filtered documents of each split, written by the filter stage in parts of about
``shard_mb`` and read back by the tokenizer's fitting and the tokenising workers.

A part of a split is ``<split>-NNNNN.txt`` (the documents' UTF-8 text, concatenated) and
``<split>-NNNNN.spans`` (int64 (n, 2): each segment's end byte and flags, ``SCORED`` for a segment a
prompt-masked objective scores, with its label, and ``FIRST`` for the first segment of a document,
which also holds the document's sampling weight).
"""

from pathlib import Path
from typing import Iterator

import numpy as np

from lmlab.prepare import shards, staging
from lmlab.prepare.work import FIRST, span_flags


class Part:
    """The documents of one split in the part being spooled."""
    def __init__(self):
        self.chunks: list[bytes] = []
        self.spans: list[tuple[int, int]] = []  # (end byte, flags) per segment
        self.size = 0
        self.documents = 0

    def add(self, segments, weight: float = 1.0) -> None:
        for i, (data, value) in enumerate(segments):
            self.chunks.append(data)
            self.size += len(data)
            self.spans.append((self.size, span_flags(int(value), i == 0, weight)))
        self.documents += 1

    def write(self, spool: Path, name: str, stage: Path | None = None) -> dict:
        """Write the part as ``name``; its segments are bytes, or text staged in ``stage`` by a Dask
        worker (:mod:`lmlab.prepare.staging`)."""
        text = staging.contents(self.chunks, stage)
        text_sha = shards.write_array(spool / f"{name}.txt", np.frombuffer(text, np.uint8))
        spans_sha = shards.write_array(spool / f"{name}.spans", np.array(self.spans, dtype="<i8").reshape(-1, 2))
        return {"documents": self.documents, "bytes": self.size, "files": {"txt": text_sha, "spans": spans_sha}}


def documents(spool: Path, name: str) -> Iterator[str]:
    """The documents of one spooled part, in order, one at a time."""
    text = (spool / f"{name}.txt").read_bytes()
    spans = np.fromfile(spool / f"{name}.spans", dtype="<i8").reshape(-1, 2)
    doc, begin = [], 0
    for end, flags in spans.tolist():
        if flags & FIRST and doc:
            yield "".join(doc)
            doc = []
        doc.append(text[begin:end].decode("utf-8"))
        begin = end
    if doc:
        yield "".join(doc)
