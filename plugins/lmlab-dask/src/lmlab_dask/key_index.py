"""Deduplication's index partitioned by key over a Dask cluster's workers (``--executor dask``).

A corpus-level filter that declares ``shuffle_keys`` (exact-dedup: the hash; minhash-dedup: the LSH
bands) decides on a document from the earlier admitted documents that share a key with it. Its index
(key → admitted documents, document → signature) is cut into one :class:`KeyShard` per worker, a
Dask actor holding the keys whose hash falls to it and the signatures whose document number does: the
bands are shuffled by key across the workers, so the index grows with the cluster, not with the
process that runs ``lmlab prepare``.

That process still decides in corpus order (the result must not depend on the executor): for each
chunk of documents the workers filtered, :class:`ShuffledAdmitter` asks every shard at once for the
documents filed under the chunk's keys and for their signatures (two rounds of messages per chunk),
then calls the filter's ``admit_among`` document by document, with the candidates from earlier
chunks and from the documents it admitted earlier in the same chunk, and files what it admitted
with the shards after the chunk. The verdicts are exactly ``admit``'s, so the shards are
byte-identical to the local executor's.

Checkpoints: at each of the preparation's checkpoints every shard writes what it was given since
the last one to ``index-JJ-SSSSS-PPP.npz`` (arrays only, never a pickle) in the partial build, which
the workers must be able to write (as they write the token shards); the filter's checkpoint records
how many segments count. A resumed preparation deletes later segments (written after the last
checkpoint by a killed run) and its new shards read the rest, each keeping what it owns, so the
number of workers may differ. A worker lost with its shard (a killed process, a lost node) loses
what was filed since the last checkpoint, which no retry can give back: the shards' calls raise
:class:`WorkerLost`, and the preparation resumes from that checkpoint on the workers that remain.
"""

import contextlib
import functools
import hashlib
import os
import re
from pathlib import Path

import numpy as np

from lmlab.api.executor import WorkerLost




@contextlib.contextmanager
def _shards_reachable():
    # Distributed says so with "Worker holding Actor was lost" (RuntimeError) or "Unable to contact
    # Actor's worker" (OSError, also a closed connection mid-call).
    try:
        yield
    except (RuntimeError, OSError) as exc:
        if isinstance(exc, RuntimeError) and "Actor" not in str(exc):
            raise
        raise WorkerLost(f"a Dask worker holding part of the deduplication index was lost ({exc})") from None


def _reaching_shards(method):
    @functools.wraps(method)
    def wrapped(*args, **kwargs):
        with _shards_reachable():
            return method(*args, **kwargs)
    return wrapped


def owner(key: bytes, shards: int) -> int:
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") % shards


class KeyShard:
    """One worker's part of the index: a Dask actor."""

    def __init__(self, index: int, shards: int):
        self.index, self.shards = index, shards
        self.keys: dict[bytes, list[int]] = {}
        self.signatures: dict[int, bytes] = {}
        self.new_keys: list[tuple[bytes, int]] = []  # since the last save
        self.new_signatures: list[tuple[int, bytes]] = []

    def sizes(self) -> tuple[int, int]:
        """(keys, signatures) this shard holds."""
        return len(self.keys), len(self.signatures)

    def lookup(self, keys: list[bytes]) -> list[list[int]]:
        return [self.keys.get(key, []) for key in keys]

    def fetch(self, documents: list[int]) -> list[bytes]:
        return [self.signatures[d] for d in documents]

    def insert(self, keys: list[tuple[bytes, int]], signatures: list[tuple[int, bytes]]) -> None:
        for key, document in keys:
            self.keys.setdefault(key, []).append(document)
        self.signatures.update(signatures)
        self.new_keys += keys
        self.new_signatures += signatures

    def save(self, path: str) -> None:
        arrays = {**_packed("key", self.new_keys), **_packed("signature", [(s, d) for d, s in self.new_signatures])}
        temporary = f"{path}.tmp{os.getpid()}"
        with open(temporary, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
        self.new_keys, self.new_signatures = [], []

    def load(self, paths: list[str]) -> None:
        for path in paths:
            with np.load(path, allow_pickle=False) as data:
                for key, document in _unpacked(data, "key"):
                    if owner(key, self.shards) == self.index:
                        self.keys.setdefault(key, []).append(document)
                for signature, document in _unpacked(data, "signature"):
                    if document % self.shards == self.index:
                        self.signatures[document] = signature


def _packed(name: str, pairs: list[tuple[bytes, int]]) -> dict[str, np.ndarray]:
    blobs = [b for b, _ in pairs]
    return {f"{name}_bytes": np.frombuffer(b"".join(blobs), dtype=np.uint8),
            f"{name}_lengths": np.array([len(b) for b in blobs], dtype=np.int64),
            f"{name}_documents": np.array([d for _, d in pairs], dtype=np.int64)}


def _unpacked(data, name: str):
    blob, ends = data[f"{name}_bytes"].tobytes(), np.cumsum(data[f"{name}_lengths"]).tolist()
    starts = [0] + ends[:-1]
    return [(blob[a:b], int(d)) for a, b, d in zip(starts, ends, data[f"{name}_documents"].tolist())]


class ShuffledAdmitter:
    """Stands in for a corpus-level filter in the preparation (``admit``, ``state_dict``,
    ``load_state_dict``, ``report``), keeping its index in :class:`KeyShard` actors."""

    def __init__(self, client, inner, number: int, partial: Path):
        self.inner, self.name, self.client, self.partial = inner, inner.name, client, Path(partial)
        workers = sorted(client.scheduler_info().get("workers", {}))
        self.n = len(workers) or 1
        # One shard on each worker (pinned: left to the scheduler, two could share one; but one that
        # has just been lost may still be listed, and another takes its shard then).
        with _shards_reachable():
            self.shards = [client.submit(KeyShard, i, self.n, actor=True, pure=False, workers=workers[i:i + 1] or None,
                                         allow_other_workers=True).result() for i in range(self.n)]
        self.prefix = f"index-{number:02d}"
        self.admitted = 0  # documents admitted so far: each one's number
        self.saved = 0  # segments written
        self.fetched: dict[bytes, list[bytes]] = {}  # this chunk's keys → signatures filed under them
        self.local: dict[bytes, list[bytes]] = {}  # keys of documents admitted in this chunk
        self.pending: list[tuple[list[bytes], int, bytes]] = []  # admitted, not yet filed

    @_reaching_shards
    def prefetch(self, signatures: list) -> None:
        """Ask the shards, all at once, for what is filed under the keys of a chunk's documents."""
        keys = sorted({k for s in signatures for k in self.inner.shuffle_keys(s)})
        asked = [[] for _ in self.shards]
        for key in keys:
            asked[owner(key, self.n)].append(key)
        found = _gather([self.shards[i].lookup(ks) for i, ks in enumerate(asked) if ks])
        filed = dict(zip((k for ks in asked if ks for k in ks), (d for part in found for d in part)))
        wanted = [[] for _ in self.shards]
        for document in sorted({d for documents in filed.values() for d in documents}):
            wanted[document % self.n].append(document)
        got = _gather([self.shards[i].fetch(ds) for i, ds in enumerate(wanted) if ds])
        signature_of = dict(zip((d for ds in wanted if ds for d in ds), (s for part in got for s in part)))
        self.fetched = {key: [signature_of[d] for d in documents] for key, documents in filed.items() if documents}
        self.local = {}

    def admit(self, signature):
        keys = self.inner.shuffle_keys(signature)
        candidates = [s for k in keys for s in (*self.fetched.get(k, ()), *self.local.get(k, ()))]
        verdict = self.inner.admit_among(signature, candidates)
        counts = self.inner.__dict__.pop("_counts", None)
        if counts:
            self.__dict__["_counts"] = counts
        if verdict is not False and verdict is not None:
            for k in keys:
                self.local.setdefault(k, []).append(signature)
            self.pending.append((keys, self.admitted, signature))
            self.admitted += 1
        return verdict

    @_reaching_shards
    def flush(self) -> None:
        """File the documents admitted since the last flush with their shards."""
        keys = [[] for _ in self.shards]
        signatures = [[] for _ in self.shards]
        for doc_keys, document, signature in self.pending:
            for k in doc_keys:
                keys[owner(k, self.n)].append((k, document))
            signatures[document % self.n].append((document, signature))
        _gather([shard.insert(keys[i], signatures[i]) for i, shard in enumerate(self.shards)
                 if keys[i] or signatures[i]])
        self.pending = []

    @_reaching_shards
    def state_dict(self) -> dict:
        self.flush()
        self.saved += 1
        _gather([shard.save(str(self._segment(self.saved, i))) for i, shard in enumerate(self.shards)])
        return {"shuffled": {"admitted": self.admitted, "segments": self.saved}}

    @_reaching_shards
    def load_state_dict(self, state: dict) -> None:
        shuffled = state.get("shuffled") if isinstance(state, dict) else None
        if not (isinstance(shuffled, dict) and isinstance(shuffled.get("admitted"), int)
                and isinstance(shuffled.get("segments"), int)):
            raise ValueError("not the checkpoint of an index partitioned over a Dask cluster")
        pattern = re.compile(rf"{self.prefix}-(\d{{5}})-\d{{3}}\.npz")
        paths = []
        for path in sorted(self.partial.glob(f"{self.prefix}-*.npz")):
            match = pattern.fullmatch(path.name)
            if match and int(match.group(1)) <= shuffled["segments"]:
                paths.append(str(path))
            else:  # written after the checkpoint by a run that was killed, or half-written
                path.unlink(missing_ok=True)
        _gather([shard.load(paths) for shard in self.shards])
        self.admitted, self.saved = shuffled["admitted"], shuffled["segments"]

    def report(self) -> list:
        return self.inner.report()

    def _segment(self, number: int, shard: int) -> Path:
        return self.partial / f"{self.prefix}-{number:05d}-{shard:03d}.npz"


def _gather(futures: list) -> list:
    return [f.result() for f in futures]
