"""A finished cache entry, ``tokens/<key>/``, checked before it is used.

A disk, a copy or a user can damage an entry after it was built; used as it is, it crashes training
or, worse, trains on wrong tokens. So the entry is verified first: ``index.json`` parses and is this
format's index of this key, and every file it names (each shard's arrays, each file of the fitted
tokenizer, and no other file in ``tokenizer/``) has the size and the SHA-256 it records.

Hashing runs at about 1 GB/s, so a process verifies an entry once: the result is remembered with the
size, modification time and inode of every file of the entry, and checked again only when one of
them changed (a rebuild, a damaged file). Each process of a job (DDP ranks) verifies on its own.
"""

import json
import os
from pathlib import Path

import numpy as np

from lmlab.prepare import shards
from lmlab.prepare.checkpoint import valid_files, valid_shard
from lmlab.prepare.shards import FORMAT, SPLITS

_verified: dict[Path, tuple[tuple, dict]] = {}  # entry folder → (its files' stat signature, its index)


class Damaged(Exception):
    """What is wrong with a cache entry, in words."""


def index(directory: Path) -> dict:
    """The index of the entry at ``directory``, once every file it names is verified; raises
    :class:`Damaged` (also when there is no entry)."""
    directory = Path(os.path.abspath(directory))
    signature = _signature(directory)
    known = _verified.get(directory)
    if known is not None and known[0] == signature:
        return known[1]
    checked = _check(directory)
    _verified[directory] = (signature, checked)
    return checked


def problem(directory: Path) -> str | None:
    """What is wrong with the entry at ``directory`` (None: it is verified and may be used)."""
    try:
        index(directory)
    except Damaged as exc:
        return str(exc)
    return None


def remember(directory: Path, built: dict) -> None:
    """Record an entry this process has just built (its checksums computed as it wrote the files)."""
    directory = Path(os.path.abspath(directory))
    _verified[directory] = (_signature(directory), built)


def _signature(directory: Path) -> tuple:
    out = []
    for path in sorted(directory.rglob("*")) if directory.is_dir() else ():
        try:
            st = path.lstat()
        except OSError:  # removed while we looked: the signature differs anyway
            continue
        out.append((path.relative_to(directory).as_posix(), st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(out)


def _check(directory: Path) -> dict:
    path = directory / "index.json"
    if not path.is_file():
        raise Damaged("index.json is missing")
    try:
        index = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise Damaged(f"index.json does not parse: {exc}") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT or index.get("key") != directory.name:
        raise Damaged("index.json is not this cache format's index of this entry")
    shards_of, dtype = index.get("shards"), index.get("dtype")
    if not (dtype in ("uint16", "uint32") and isinstance(index.get("masked"), bool)
            and isinstance(shards_of, dict) and all(isinstance(shards_of.get(split), list) for split in SPLITS)
            and all(isinstance(index.get(field), dict) for field in ("documents", "tokens", "source", "filters"))
            and valid_files(index.get("tokenizer"))):
        raise Damaged("index.json lacks what an index holds")
    weighted = index.get("weighted", False)  # absent from indexes written before document weights
    if not isinstance(weighted, bool):
        raise Damaged("index.json lacks what an index holds")
    sizes = {"bin": np.dtype(dtype).itemsize, "docs": 8, "mask": 1, "weights": 4}
    expected = {"bin", "docs"} | ({"mask"} if index["masked"] else set()) | ({"weights"} if weighted else set())
    for split in SPLITS:
        for shard in shards_of[split]:
            if not valid_shard(shard, split) or set(shard["files"]) != expected:
                raise Damaged(f"index.json lists a {split} shard it could not have written")
            for suffix, digest in shard["files"].items():
                count = shard["documents"] if suffix in ("docs", "weights") else shard["tokens"]
                _verify(directory, f"{shard['name']}.{suffix}", digest, count * sizes[suffix])
    tokenizer = directory / "tokenizer"
    present = {p.relative_to(tokenizer).as_posix() for p in tokenizer.rglob("*") if not p.is_dir()}
    unlisted = sorted(present - set(index["tokenizer"]))
    if unlisted:
        raise Damaged(f"tokenizer/{unlisted[0]} is not one of the fitted tokenizer's files")
    for name, digest in index["tokenizer"].items():
        _verify(directory, f"tokenizer/{name}", digest)
    return index


def _verify(directory: Path, name: str, digest: str, size: int | None = None) -> None:
    path = directory / name
    if path.is_symlink() or not path.is_file():
        raise Damaged(f"{name} is missing")
    actual = path.stat().st_size
    if size is not None and actual != size:
        raise Damaged(f"{name} holds {actual:,} bytes, not the {size:,} its index records")
    if shards.sha256_file(path) != digest:
        raise Damaged(f"{name} does not match its SHA-256")
