"""Sharded token files: the on-disk format of a prepared corpus, and the array view that reads it.

A split is a sequence of shards ``<split>-NNNNN``, each a set of raw little-endian arrays (nanoGPT's
``train.bin`` format, so ``np.memmap`` opens them without a header):

    <split>-NNNNN.bin    token ids (uint16 when the vocabulary fits, else uint32)
    <split>-NNNNN.docs   uint64 offset of each document's first token within the shard
    <split>-NNNNN.mask   uint8 per token, 1 where a prompt-masked objective scores it (only for
                         corpora with Records that have unscored segments)
    <split>-NNNNN.weights  float32 per document, its sampling weight (only for corpora whose filters
                         weighed a document below 1)

``index.json`` lists the shards of each split in order with their token and document counts and the
SHA-256 of every file, so a resumed preparation can verify what it keeps. Reading, the shards of a
split form one virtual 1-D array (:class:`ShardedTokens`) that windows may cross.
"""

import hashlib
import os
import secrets
import shutil
from pathlib import Path

import numpy as np

FORMAT = 3  # of index.json and a build's state.json: bump when the cache layout changes
SPLITS = ("train", "val")
SUFFIXES = {"bin": None, "docs": "<u8", "mask": "u1", "weights": "<f4"}  # None: the corpus's token dtype
CHUNK = 1 << 20


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}"


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (GPT-2's 50,257 does), else uint32: half the disk and page cache."""
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def temporary(path: Path) -> Path:
    """A name beside ``path`` that no other process or thread picks, for writing ``path`` atomically
    (write there, then rename): two preparations writing at once never share a half-written file.
    Not ``tempfile.mkstemp``, whose mode 0600 would hide a shared cache from its other users."""
    return path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")


def remove(path: Path) -> None:
    """Delete a file or folder; a symbolic link itself, never what it points to."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.is_dir():
        shutil.rmtree(path, ignore_errors=True)


def files_sha256(folder: Path) -> dict[str, str]:
    """Relative path (with ``/``) → SHA-256 of every file under ``folder``, sorted by path."""
    return {path.relative_to(folder).as_posix(): sha256_file(path)
            for path in sorted(folder.rglob("*")) if path.is_file()}


def write_bytes(path: Path, data) -> None:
    """Write ``data`` (bytes or a buffer) to ``path`` atomically."""
    tmp = temporary(path)
    try:
        with open(tmp, "xb") as f:
            f.write(data)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_array(path: Path, array: np.ndarray) -> str:
    """Write ``array``'s raw bytes to ``path`` atomically; returns their SHA-256."""
    data = memoryview(np.ascontiguousarray(array)).cast("B")
    write_bytes(path, data)
    return hashlib.sha256(data).hexdigest()


def verify(directory: Path, shard: dict) -> bool:
    """Whether every file of ``shard`` (an index entry) is there with the recorded checksum."""
    for suffix, digest in shard["files"].items():
        path = directory / f"{shard['name']}.{suffix}"
        if not path.is_file() or sha256_file(path) != digest:
            return False
    return True


class ShardedTokens:
    """Several memory-mapped shards seen as one 1-D array: ``len``, integer, slice and integer-array
    indexing (any shape) like a numpy array, so token windows may cross shard boundaries."""

    def __init__(self, parts: list[np.ndarray]):
        self.parts = parts
        sizes = np.array([len(p) for p in parts], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(sizes)])  # (n_shards + 1,)
        self.dtype = parts[0].dtype
        self.shape = (int(self.starts[-1]),)

    def __len__(self) -> int:
        return self.shape[0]

    @property
    def ndim(self) -> int:
        return 1

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return self[np.arange(start, stop, step)]
            return self._range(start, stop)
        if np.isscalar(index):
            i = int(index) + (len(self) if int(index) < 0 else 0)
            if not 0 <= i < len(self):
                raise IndexError(f"index {index} is out of bounds for {len(self)} tokens")
            shard = int(np.searchsorted(self.starts, i, side="right")) - 1
            return self.parts[shard][i - self.starts[shard]]
        index = np.asarray(index)
        out = np.empty(index.shape, dtype=self.dtype)
        shard = np.searchsorted(self.starts, index, side="right") - 1  # (...,) which shard holds each
        for s in np.unique(shard):
            where = shard == s
            out[where] = self.parts[s][index[where] - self.starts[s]]
        return out

    def _range(self, start: int, stop: int) -> np.ndarray:
        if stop <= start:
            return np.empty(0, dtype=self.dtype)
        first = int(np.searchsorted(self.starts, start, side="right")) - 1
        last = int(np.searchsorted(self.starts, stop - 1, side="right")) - 1
        if first == last:
            return self.parts[first][start - self.starts[first]:stop - self.starts[first]]
        pieces = [self.parts[first][start - self.starts[first]:]]
        pieces += self.parts[first + 1:last]
        pieces.append(self.parts[last][:stop - self.starts[last]])
        return np.concatenate(pieces)

    def __array__(self, dtype=None, copy=None):
        whole = np.concatenate(self.parts)
        return whole if dtype is None else whole.astype(dtype)

    def astype(self, dtype) -> np.ndarray:
        return np.asarray(self, dtype=dtype)


def open_split(directory: Path, shards: list[dict], suffix: str, dtype) -> np.ndarray | ShardedTokens:
    """One split's arrays of one kind (tokens, mask) as a single array-like; one shard: its memmap."""
    parts = []
    for shard in shards:
        n = shard["tokens"]
        path = directory / f"{shard['name']}.{suffix}"
        # np.memmap refuses empty files; an empty shard is never written, but keep the view total.
        parts.append(np.memmap(path, dtype=dtype, mode="r", shape=(n,)) if n else np.zeros(0, dtype))
    if len(parts) == 1:
        return parts[0]
    return ShardedTokens(parts)
