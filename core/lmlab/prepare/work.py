"""The per-document work of ``lmlab prepare``, run in worker processes (and in the main one).

Two kinds of task, both pure functions of their input, so which process runs a task never changes
the result: :meth:`Worker.filter_chunk` passes a chunk of documents through the filters (and computes
the signatures that corpus-level filters compare in the main process), and
:meth:`Worker.tokenize_part` turns one spooled text part into a token shard. :class:`Workers` hands
tasks to a pool of processes started with ``forkserver`` (``spawn`` where there is none: a forked
copy of a process that has started torch's threads can deadlock) and yields results in task order,
running tasks itself while the pool is busy or still starting.
"""

import multiprocessing
import os
import signal
import sys
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from lmlab.api import Record, document_text
from lmlab.api.executor import PluginSpec, WorkerLost  # noqa: F401 - the core's own, re-exported
from lmlab.prepare.shards import SUFFIXES, shard_name, write_array

# Flags of a spooled span (one segment of a document): scored by a prompt-masked objective, and
# first segment of its document; bits from LABEL_SHIFT up hold the mask value of a scored segment
# (Segment.label), which spools written before labels existed leave 0 (meaning 1).
SCORED, FIRST = 1, 2
LABEL_SHIFT = 8


WEIGHT_SHIFT = 32  # a document's first span holds its sampling weight, as float32 bits of (1 - weight)


def span_flags(mask_value: int, first: bool, weight: float = 1.0) -> int:
    """A spooled segment's flags: ``mask_value`` (0 unscored, else the segment's label), whether it
    opens its document, and on the first segment the document's sampling weight (stored as 1 − weight,
    so that spools written before weights existed read as weight 1)."""
    flags = (SCORED if mask_value else 0) | (FIRST if first else 0) | (mask_value << LABEL_SHIFT)
    if first and weight != 1.0:
        flags |= int(np.array(1.0 - weight, dtype="<f4").view("<u4")) << WEIGHT_SHIFT
    return flags


def span_weight(flags: int) -> float:
    """The sampling weight a document's first span holds."""
    return 1.0 - float(np.array(flags >> WEIGHT_SHIFT, dtype="<u4").view("<f4"))


def mask_value(flags: int) -> int:
    """The loss mask's value on a spooled segment's tokens."""
    if not flags & SCORED:
        return 0
    return ((flags >> LABEL_SHIFT) & 0xFF) or 1


@dataclass(frozen=True)
class TokenizeTask:
    spool: Path  # the folder of spooled text parts
    out: Path  # where the shard goes
    split: str
    index: int
    tokenizer: PluginSpec
    tokenizer_dir: Path
    dtype: str
    separate_documents: bool  # append the tokenizer's end-of-document id after each document
    masked: bool  # write the loss mask
    weighted: bool = False  # write each document's sampling weight


def checked_weight(value, who: str) -> float:
    """A filter's weight as a float in [0, 1]; a plugin that gives anything else is broken (TypeError)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= float(value) <= 1.0:
        raise TypeError(f"{who} returned {value!r}; a document's weight is a number in [0, 1]")
    return float(value)


class Worker:
    def __init__(self, filters: list[PluginSpec]):
        self.filters = [spec.build() for spec in filters]
        self._tokenizers: dict[Path, Any] = {}

    def filter_chunk(self, chunk: list[Any]) -> list[tuple]:
        """Each document of ``chunk`` through the filters, in order. Per document:
        (input bytes, kept segments as ((utf-8 bytes, mask value), ...) or None, is plain text,
        trace: one (chars in, chars out, changed, counts, dropped, weight) per filter reached,
        {filter index: signature} of the corpus-level filters reached, the document's weight: the
        product of the filters' ``weigh``)."""
        return [self._filter_one(doc) for doc in chunk]

    def _filter_one(self, doc) -> tuple:
        text = document_text(doc)
        size = len(text.encode("utf-8"))
        trace, signatures, weight = [], {}, 1.0
        for j, f in enumerate(self.filters):
            n_in = len(text)
            if f.corpus_level:
                signatures[j] = f.signature(text)
                trace.append((n_in, n_in, False, f.__dict__.pop("_counts", None), False, 1.0))
                continue
            out = f.apply(doc)
            if out is None:
                trace.append((n_in, 0, False, f.__dict__.pop("_counts", None), True, 0.0))
                return size, None, isinstance(doc, str), trace, signatures, 0.0
            changed = out != doc
            doc = out
            text = document_text(doc) if changed else text
            own = checked_weight(f.weigh(doc), f"filter {f.name!r}: weigh")
            weight *= own
            trace.append((n_in, len(text), changed, f.__dict__.pop("_counts", None), False, own))
        if isinstance(doc, Record):
            segments = tuple((s.text.encode("utf-8"), s.mask_value) for s in doc.segments)
        else:
            segments = ((doc.encode("utf-8"), 1),)
        return size, segments, isinstance(doc, str), trace, signatures, weight

    def read_part(self, task) -> tuple[list[tuple], dict]:
        """One part of the data source read here and filtered, its kept text staged
        (:func:`lmlab.prepare.staging.read_part`)."""
        from lmlab.prepare import staging

        return staging.read_part(task, self._filter_one)

    def write_part(self, task: tuple) -> dict:
        """A spool part written here from the text staged by :meth:`read_part`: ``task`` is
        (part, spool folder, name, staging folder)."""
        part, spool, name, stage = task
        return part.write(spool, name, stage)

    def tokenize_part(self, task: TokenizeTask) -> dict:
        """The token shard of one spooled part: its files written, and its index entry."""
        tokenizer = self._tokenizer(task.tokenizer, task.tokenizer_dir)
        name = shard_name(task.split, task.index)
        text = (task.spool / f"{name}.txt").read_bytes()
        spans = np.fromfile(task.spool / f"{name}.spans", dtype="<i8").reshape(-1, 2)  # (n, 2): end, flags
        dtype = np.dtype(task.dtype)
        eos = tokenizer.eos_id if task.separate_documents else None
        ids, masks, starts, weights = [], [], [], []
        n, begin, last = 0, 0, 1
        for i, (end, flags) in enumerate(spans.tolist()):
            if flags & FIRST:
                if i and eos is not None:
                    ids.append(np.array([eos], dtype=dtype))
                    masks.append(np.full(1, last, dtype=np.uint8))
                    n += 1
                starts.append(n)
                weights.append(span_weight(flags))
            piece = np.asarray(tokenizer.encode(text[begin:end].decode("utf-8")), dtype=dtype)
            ids.append(piece)
            value = mask_value(flags)
            if task.masked:
                masks.append(np.full(len(piece), value, dtype=np.uint8))
            # The end-of-document token is scored with the document's last segment (1 after an unscored one).
            last = value or 1
            n += len(piece)
            begin = end
        if len(spans) and eos is not None:
            ids.append(np.array([eos], dtype=dtype))
            masks.append(np.full(1, last, dtype=np.uint8))
            n += 1
        arrays = {"bin": np.concatenate(ids) if ids else np.zeros(0, dtype),
                  "docs": np.asarray(starts, dtype=SUFFIXES["docs"])}
        if task.masked:
            arrays["mask"] = np.concatenate(masks) if masks else np.zeros(0, np.uint8)
        if task.weighted:
            arrays["weights"] = np.asarray(weights, dtype=SUFFIXES["weights"])
        files = {suffix: write_array(task.out / f"{name}.{suffix}", array) for suffix, array in arrays.items()}
        return {"name": name, "tokens": n, "documents": len(starts), "files": files}

    def _tokenizer(self, spec: PluginSpec, directory: Path):
        if directory not in self._tokenizers:
            tokenizer = spec.build()
            tokenizer.load(directory)
            self._tokenizers[directory] = tokenizer
        return self._tokenizers[directory]


_worker: Worker | None = None  # this process's, when it is a pool worker


def _init(filters: list[PluginSpec]) -> None:
    global _worker
    # Ctrl-C reaches the whole process group: the main process stops the pool, and a worker that
    # died of it mid-task would only turn a clean interrupt into a broken pool.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _worker = Worker(filters)


def _run(method: str, item):
    return getattr(_worker, method)(item)


def _ping() -> bool:
    return True  # back once a worker has started (the initializer has run)


class _Done:
    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


class Workers:
    """``n`` processes working through tasks: this one and a pool of ``n - 1``, started by
    :meth:`start` or by :meth:`map` once it has two tasks. :meth:`map` yields results in task order."""

    def __init__(self, n: int, filters: list[PluginSpec]):
        self.n = max(1, n)
        self.filters = filters
        self.local = Worker(filters)
        self.executor: ProcessPoolExecutor | None = None
        self._pings: list[Future] = []

    def map(self, method: str, items: Iterable, parallel: bool = True) -> Iterator:
        """Results of ``method`` on each item, in order; ``parallel=False`` keeps the work here (too
        little to be worth starting the pool)."""
        local = getattr(self.local, method)
        items = iter(items)
        if not parallel or not self.start(lazily=True):
            yield from map(local, items)
            return
        if self.executor is None:  # started only for two tasks or more
            head = [x for x in (next(items, _END), next(items, _END)) if x is not _END]
            if len(head) < 2:
                yield from map(local, head)
                return
            self.start()
            items = _chain(head, items)
        yield from self._shared(method, local, items)

    def start(self, lazily: bool = False) -> bool:
        """Start the pool (``lazily``: only say whether one can be started); False when there is
        none to start: one process, or a parent script that new processes cannot import."""
        if self.n == 1 or not _main_is_importable():
            return False
        if self.executor is None and not lazily:
            method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
            self.executor = ProcessPoolExecutor(self.n - 1, mp_context=multiprocessing.get_context(method),
                                                initializer=_init, initargs=(self.filters,))
            self._pings = [self.executor.submit(_ping) for _ in range(self.n - 1)]
        return True

    def _shared(self, method: str, local, items: Iterator) -> Iterator:
        # Each pool worker that has started (its ping is back) is kept two tasks busy; while the oldest
        # task is not back (the pool starting, or simply busy), this process runs the next task itself.
        # Results wait in `pending`, in task order, bounded so that memory stays bounded.
        busy_per_worker, limit = 2, 4 * self.n + 4
        pending: deque = deque()
        exhausted = False
        while True:
            ready = sum(ping.done() for ping in self._pings)
            busy = sum(isinstance(p, Future) and not p.done() for p in pending)
            while not exhausted and busy < busy_per_worker * ready and len(pending) < limit:
                item = next(items, _END)
                if item is _END:
                    exhausted = True
                    break
                pending.append(self.executor.submit(_run, method, item))
                busy += 1
            head = pending[0] if pending else None
            waiting = head is None or (isinstance(head, Future) and not head.done())
            if waiting and not exhausted and len(pending) < limit:
                item = next(items, _END)
                if item is _END:
                    exhausted = True
                else:
                    pending.append(_Done(local(item)))
                continue
            if head is None:
                return
            pending.popleft()
            yield head.result() if isinstance(head, Future) else head.value

    def close(self) -> None:
        if self.executor is None:
            return
        if all(ping.done() for ping in self._pings):
            self.executor.shutdown(wait=True, cancel_futures=True)
        else:
            # Workers still importing their plugins (a second or more each) have done nothing yet: a
            # short corpus was done without them, and waiting for them to start only to stop is waste.
            self.executor.shutdown(wait=False, cancel_futures=True)
            for process in list((getattr(self.executor, "_processes", None) or {}).values()):
                process.terminate()
                process.join()
        self.executor = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_END = object()


def _main_is_importable() -> bool:
    # A new worker process imports the parent's __main__ from its file; a script read from stdin
    # has none, and every worker would die on start.
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    return path is None or os.path.exists(path)


def _chain(head: list, rest: Iterator) -> Iterator:
    yield from head
    yield from rest
