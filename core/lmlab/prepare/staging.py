"""The source read on the workers of a Dask preparation (``--executor dask``), its kept text staged
there, so that no document passes through the process that runs ``lmlab prepare``.

A data source that can be cut (``DataSource.parts``, API 1.16) is read piece by piece, each piece by
one worker (:func:`read_part`), which filters its documents and appends the kept text to
``stage/NNNNNN.bin`` in the partial build (written whole, then renamed: a task that a lost worker
ran again writes the same file). What comes back to the main process is each document's outcome
with its segments as :class:`Staged` references, not bytes: the main process still decides in corpus
order what the corpus-level filters keep and where each document goes, and closes spool parts at the
same sizes as the local executor; a worker then writes each spool part from the staged bytes
(:meth:`lmlab.prepare.spool.Part.write`). So the spool, and with it the shards, are byte-identical
to the local executor's. The main process reads staged text only for the one document it holds back
at a checkpoint (:func:`resolved`).
"""

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from lmlab.api import Conversation, Record
from lmlab.prepare import shards


@dataclass(frozen=True, slots=True)
class Staged:
    """A segment's UTF-8 text in a staging file: ``length`` bytes at ``offset`` of file ``file``."""

    file: int
    offset: int
    length: int

    def __len__(self) -> int:  # what a spool part counts of a segment
        return self.length


@dataclass(frozen=True)
class ReadTask:
    source: Any  # the data source as a worker rebuilds it (a PluginSpec)
    part: Any  # one of its parts
    number: int  # the part's number: the name of its staging file
    stage: Path  # the staging folder
    conversations: Any  # the ConversationWriter of the source's Conversations


def path_of(stage: Path, number: int) -> Path:
    return stage / f"{number:06d}.bin"


def read_part(task: ReadTask, filter_one: Callable[[Any], tuple]) -> tuple[list[tuple], dict]:
    """Read one part of the source, pass each document through ``filter_one`` and stage the kept
    text; returns the outcomes (segments as :class:`Staged`) and the source's counts for the part."""
    source = task.source.build()
    path = path_of(task.stage, task.number)
    tmp = shards.temporary(path)
    outcomes = []
    try:
        with open(tmp, "xb") as f:
            offset = 0
            for number, doc in enumerate(source.documents_in(task.part), 1):
                if isinstance(doc, Conversation):
                    doc = task.conversations.record(doc, f"{source.name} part {task.number + 1} document {number}")
                elif not isinstance(doc, (str, Record)):
                    raise TypeError(f"data plugin {source.name!r} yielded a {type(doc).__name__}; documents "
                                    "are str, lmlab.api.Record or lmlab.api.Conversation")
                size, segments, is_text, trace, signatures, weight = filter_one(doc)
                if segments is not None:
                    refs = []
                    for data, value in segments:
                        f.write(data)
                        refs.append((Staged(task.number, offset, len(data)), value))
                        offset += len(data)
                    segments = tuple(refs)
                outcomes.append((size, segments, is_text, trace, signatures, weight))
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return outcomes, source.stats()


def contents(chunks: Iterable, stage: Path | None) -> bytes:
    """The bytes of a spool part's chunks: bytes as they are, :class:`Staged` read from their file."""
    out, files = [], {}
    try:
        for chunk in chunks:
            if isinstance(chunk, Staged):
                f = files.get(chunk.file)
                if f is None:
                    f = files[chunk.file] = open(path_of(stage, chunk.file), "rb")
                f.seek(chunk.offset)
                data = f.read(chunk.length)
                if len(data) != chunk.length:
                    raise OSError(f"the staged text {path_of(stage, chunk.file)} is shorter than recorded")
                out.append(data)
            else:
                out.append(chunk)
    finally:
        for f in files.values():
            f.close()
    return b"".join(out)


def resolved(doc, stage: Path):
    """A held-back document ((segments, is plain text, weight)) with its staged segments read."""
    if doc is None:
        return None
    segments, is_text, weight = doc
    return tuple((contents([data], stage), value) for data, value in segments), is_text, weight


def prune(stage: Path, below: int) -> None:
    """Delete the staging files numbered below ``below``: every document in them is spooled."""
    try:
        names = os.listdir(stage)
    except FileNotFoundError:
        return
    for name in names:
        stem = name.partition(".")[0]
        if name.endswith(".bin") and stem.isdigit() and int(stem) < below:
            (stage / name).unlink(missing_ok=True)
