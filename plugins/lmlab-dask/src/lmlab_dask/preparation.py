"""``lmlab prepare --executor dask``: the preparation's tasks on a Dask cluster instead of local processes.

The tasks are the local executor's (the ``PreparationKit``'s worker: ``filter_chunk`` and
``tokenize_part``): pure functions of their input, whose results this process takes in task order.
So the shards are byte-identical whichever executor, cluster or worker count made them, and an
interrupted preparation resumes from the same checkpoints. The workers read the source part by part
(``DataSource.parts``, API 1.16), filter it, compute signatures and stage the kept text
(``ReadTask``), write the spool parts and tokenise them into shards; this process
plans the parts, decides what the corpus-level filters keep (in corpus order, on the signatures the
workers computed, so a near-duplicate is found whichever worker saw its twin), where each document
goes and where a part ends, and writes the checkpoints and the index. A source that cannot be cut
is read here, and its documents sent to the workers. On a real cluster the data and the cache
folder must therefore be on a filesystem every worker can read and write.

Without an address, a local cluster of ``workers`` single-threaded processes is started and
stopped with the preparation; with one (``tcp://host:8786``, from ``dask-scheduler`` and
``dask-worker``, ``dask-jobqueue`` on SLURM or the Dask Kubernetes operator), the existing cluster
is used and left running. Each worker builds the filters once and keeps them for later tasks.
"""

import hashlib
import pickle
from collections import deque
from pathlib import Path
from typing import Any, Iterable, Iterator

from lmlab.api.executor import PluginSpec, PreparationKit
from lmlab_dask.cluster import Cluster

_workers: dict[str, Any] = {}  # in a Dask worker process: the task runner of each set of filters


def _run(token: str, kit: PreparationKit, filters: list[PluginSpec], method: str, item: Any) -> Any:
    worker = _workers.get(token)
    if worker is None:
        worker = _workers[token] = kit.worker(filters)
    return getattr(worker, method)(item)


class DaskWorkers:
    """The interface of the core's local pool over a Dask client: :meth:`map` yields
    results in task order, with a bounded number of tasks in flight."""

    def __init__(self, n: int, filters: list[PluginSpec], kit: PreparationKit, scheduler: str | None = None,
                 listener=None):
        self.n, self.filters, self.kit, self.scheduler, self.listener = max(1, n), filters, kit, scheduler, listener
        self.token = hashlib.sha256(pickle.dumps(filters)).hexdigest()[:16]
        self.cluster = Cluster(scheduler, self.n)
        self._local = None
        self._admitters: dict = {}  # corpus-level filter number → its ShuffledAdmitter

    @property
    def executor(self):
        """The distributed.Client, once connected."""
        return self.cluster.client

    @property
    def local(self):
        if self._local is None:
            self._local = self.kit.worker(self.filters)
        return self._local

    def start(self, lazily: bool = False) -> bool:
        if lazily or self.executor is not None:
            return True
        client = self.cluster.connect()
        if self.listener is not None:
            self.listener("executor", {"scheduler": client.scheduler.address, "workers": self.workers(),
                                       "dashboard": self.cluster.dashboard()})
        return True

    def workers(self) -> int:
        return len(self.cluster.workers()) or 1

    def admitting(self, number: int, instance, partial: Path):
        """What decides for corpus-level filter ``number`` of the build in ``partial``: the filter,
        or, when it can be partitioned by key (``Filter.shuffle_keys``), a stand-in whose index is
        spread over the workers (:mod:`lmlab_dask.key_index`)."""
        from lmlab.api import Filter
        from lmlab_dask.key_index import ShuffledAdmitter

        if type(instance).shuffle_keys is Filter.shuffle_keys:
            self._admitters.pop(number, None)
            return instance
        self.start()
        self._admitters[number] = ShuffledAdmitter(self.executor, instance, number, partial)
        return self._admitters[number]

    def map(self, method: str, items: Iterable, parallel: bool = True) -> Iterator:
        """Results of ``method`` on each item, in order, computed on the cluster (``parallel`` is
        ignored: the cluster was asked for)."""
        results = self._ordered(method, items)
        return self._admitted(results) if method == "filter_chunk" else results

    def _admitted(self, chunks: Iterable[list]) -> Iterator[list]:
        # Around each filtered chunk, the partitioned indexes fetch what the chunk's keys need
        # before it is folded, and file what was admitted after.
        for chunk in chunks:
            for number, admitter in self._admitters.items():
                admitter.prefetch([outcome[4][number] for outcome in chunk if number in outcome[4]])
            yield chunk
            for admitter in self._admitters.values():
                admitter.flush()

    def reading(self, source, stage: Path, skip: int, size: int, conversations) -> "Reading | None":
        """The filtered outcomes of ``source``'s documents after the first ``skip``, read by the
        workers part by part, its Conversations written out by
        ``conversations`` (a ConversationWriter); None when the source cannot be cut into parts (a
        plugin without ``DataSource.parts``): this process reads it then."""
        from lmlab.api import DataSource

        parts = None if type(source).parts is DataSource.parts else source.parts(size)
        if parts is None:
            if self.listener is not None:
                self.listener("note", {"text": f"data plugin {source.name!r} cannot be cut into parts "
                                               "(DataSource.parts, API 1.16): this process reads it and sends "
                                               "the documents to the workers"})
            return None
        stage.mkdir(parents=True, exist_ok=True)
        return Reading(self, PluginSpec(type(source), source.name, source.options), parts, stage, skip, conversations)

    def write_part(self, part, spool: Path, name: str, stage: Path) -> dict:
        """Write a spool part on a worker, from the text the workers staged."""
        self.start()
        return self.executor.submit(_run, self.token, self.kit, self.filters, "write_part", (part, spool, name, stage),
                                    pure=False).result()

    def _ordered(self, method: str, items: Iterable) -> Iterator:
        self.start()
        limit = 2 * self.workers() + 2  # keeps every worker busy while bounding the results held here
        pending: deque = deque()
        try:
            for item in items:
                pending.append(self.executor.submit(_run, self.token, self.kit, self.filters, method, item, pure=False))
                if len(pending) >= limit:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()

    def close(self) -> None:
        self._admitters.clear()  # their actors live on the cluster: released with the client
        self.cluster.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Reading:
    """The outcomes of a source read by the workers, chunk (part) by chunk, in corpus order; then
    ``stats``, the source's counts summed over its parts."""

    def __init__(self, pool: DaskWorkers, source: PluginSpec, parts: list, stage: Path, skip: int, conversations):
        self.pool, self.source, self.parts, self.stage, self.skip = pool, source, parts, stage, skip
        self.conversations = conversations
        self.current = 0  # the number of the part whose outcomes are being folded
        self.stats: dict[str, int] = {}

    def __iter__(self) -> Iterator[list]:
        tasks = (self.pool.kit.read_task(self.source, part, i, self.stage, self.conversations) for i, part in enumerate(self.parts))
        return self.pool._admitted(self._outcomes(self.pool._ordered("read_part", tasks)))

    def _outcomes(self, results: Iterator) -> Iterator[list]:
        # A resumed preparation reads its source again from the start (each part's counts are
        # needed); the documents it had already taken are dropped here.
        for number, (outcomes, stats) in enumerate(results):
            self.current = number
            for what, n in stats.items():
                self.stats[what] = self.stats.get(what, 0) + n
            if self.skip:
                dropped = min(self.skip, len(outcomes))
                outcomes, self.skip = outcomes[dropped:], self.skip - dropped
            if outcomes:
                yield outcomes
