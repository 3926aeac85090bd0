"""What an interrupted preparation resumes from, read back with suspicion.

``state.json`` holds the build's progress (JSON); during the filter stage, ``filters-NNNNN.npz`` holds
what the corpus-level filters have learnt (``Filter.state_dict``) and the one kept document held back,
as NumPy arrays that ``state.json`` describes with the file's SHA-256.

Never a pickle: the cache is often shared (a cluster's scratch space), and unpickling a planted file
runs the code it names as whoever prepares next. ``np.load(allow_pickle=False)`` refuses object
arrays, so a checkpoint, planted or damaged, yields data and nothing else; and every name that
``state.json`` gives for a file is checked to be one the build writes, so that a damaged or planted
state never makes the build read, write or delete outside its folder. Whatever does not fit raises
:class:`Unusable`, and the build starts over.
"""

import json
import re
from pathlib import Path

import numpy as np

from lmlab.prepare import shards
from lmlab.prepare.report import new_stats

CHECKPOINT = re.compile(r"filters-\d{5}\.npz")
SHA256 = re.compile(r"[0-9a-f]{64}")
STAGES = ("filter", "fit", "tokenize")
JSON_SCALARS = (str, int, float, bool, type(None))


class Unusable(ValueError):
    """A partial build that cannot be resumed; the message says why."""


# -- the corpus-level filters and the held-back document ----------------------------------------------

def save(folder: Path, name: str, filters: dict[int, tuple[str, object]], pending) -> dict | None:
    """Write the checkpoint ``folder/name`` of ``filters`` (index → (name, instance)) and ``pending``
    (the document held back: (((utf-8 bytes, mask value), ...), is plain text, weight), or None); returns its
    description for ``state.json``, or None, writing nothing, when a filter's ``state_dict`` is None."""
    arrays: dict[str, np.ndarray] = {}
    described = {}
    for j, (filter_name, instance) in filters.items():
        state = instance.state_dict()
        if state is None:
            return None
        if not isinstance(state, dict):
            raise TypeError(f"filter {filter_name!r}: state_dict() returned a {type(state).__name__}, not a dict")
        found: list[list] = []
        tree = _split(state, [], found, filter_name)
        for k, (path, array) in enumerate(found):
            arrays[f"filter{j}-{k}"] = array
        described[str(j)] = {"state": tree, "arrays": [path for path, _ in found]}
    held = None
    if pending is not None:
        segments, is_text, weight = pending
        arrays["pending"] = np.frombuffer(b"".join(data for data, _ in segments), dtype=np.uint8)
        ends = np.cumsum([len(data) for data, _ in segments]).tolist()
        held = {"ends": ends, "scored": [int(value) for _, value in segments], "is_text": bool(is_text),
                "weight": float(weight)}
    path = folder / name
    tmp = shards.temporary(path)
    try:
        with open(tmp, "xb") as f:
            np.savez(f, **arrays)
        digest = shards.sha256_file(tmp)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return {"file": name, "sha256": digest, "filters": described, "pending": held}


def load(folder: Path, description, filters: dict[int, tuple[str, object]]):
    """Load the checkpoint that ``description`` (from :func:`save`) names into the fresh instances of
    ``filters``; returns the held-back document. Raises :class:`Unusable`."""
    _require(isinstance(description, dict), "its filter checkpoint is not described")
    name = description.get("file")
    _require(isinstance(name, str) and CHECKPOINT.fullmatch(name),
             f"its filter checkpoint {name!r} is not one it writes")
    path = folder / name
    _require(path.is_file() and not path.is_symlink(), f"its filter checkpoint {name} is missing")
    _require(shards.sha256_file(path) == description.get("sha256"), f"{name} does not match its recorded SHA-256")
    described = description.get("filters")
    _require(isinstance(described, dict) and set(described) == {str(j) for j in filters},
             f"{name} does not hold the state of this build's filters")
    try:
        with np.load(path, allow_pickle=False) as npz:
            for j, (filter_name, instance) in filters.items():
                entry = described[str(j)]
                state = entry["state"]
                for k, where in enumerate(entry["arrays"]):
                    state = _placed(state, where, npz[f"filter{j}-{k}"])
                _require(isinstance(state, dict), f"{name}: the state of filter {filter_name!r} is not a dict")
                instance.load_state_dict(state)
            held = description.get("pending")
            if held is None:
                return None
            data = npz["pending"].tobytes()
            starts = [0, *held["ends"][:-1]]
            # "scored" held booleans before segments had labels: True is label 1.
            segments = tuple((data[a:b], int(value)) for a, b, value in zip(starts, held["ends"], held["scored"],
                                                                            strict=True))
            _require(bool(segments) and held["ends"][-1] == len(data), f"{name}: the held-back document is damaged")
            return segments, bool(held["is_text"]), float(held.get("weight", 1.0))
    except Unusable:
        raise
    except Exception as exc:  # a damaged file, or a state its filter refuses (ValueError by contract)
        raise Unusable(f"{name} does not load: {type(exc).__name__}: {exc}") from None


def _split(value, path: list, found: list, who: str):
    """``value`` with each array replaced by None, its path and the array appended to ``found``."""
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            raise TypeError(f"filter {who!r}: state_dict() holds an object array at {path}; arrays of numbers, "
                            "bytes or strings only")
        found.append((list(path), value))
        return None
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError(f"filter {who!r}: state_dict() has a key that is not a string at {path}")
        return {k: _split(v, [*path, k], found, who) for k, v in value.items()}
    if isinstance(value, list):
        return [_split(v, [*path, i], found, who) for i, v in enumerate(value)]
    if isinstance(value, JSON_SCALARS):
        return value
    raise TypeError(f"filter {who!r}: state_dict() holds a {type(value).__name__} at {path}; NumPy arrays and "
                    "JSON values (str, int, float, bool, None, lists, dicts) only")


def _placed(tree, path: list, array: np.ndarray):
    if not path:
        return array
    head, rest = path[0], path[1:]
    tree[head] = _placed(tree[head], rest, array)
    return tree


# -- state.json -----------------------------------------------------------------------------------

def read_state(path: Path, fmt: int, key: str, filter_names: list[str], splits: tuple[str, ...]) -> dict | None:
    """The state of the partial build at ``path``, checked to be one this build could have written;
    None when there is none. Raises :class:`Unusable`."""
    if not path.exists():
        return None
    try:
        state = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise Unusable(f"state.json does not parse: {exc}") from None
    _require(isinstance(state, dict) and state.get("format") == fmt and state.get("key") == key,
             "state.json is not this cache format's state of this key")
    stage = state.get("stage")
    _require(stage in STAGES, f"state.json names no stage it has ({stage!r})")
    _require(_count(state.get("shard_bytes")) and state["shard_bytes"] > 0, "state.json: bad shard_bytes")
    for field in ("consumed", "input_bytes", "kept"):
        _require(_count(state.get(field)), f"state.json: bad {field}")
    documents = state.get("documents")
    _require(isinstance(documents, dict) and set(documents) == set(splits) and all(map(_count, documents.values())),
             "state.json: bad documents")
    _require(isinstance(state.get("masked"), bool), "state.json: bad masked")
    parts = state.get("parts")
    _require(isinstance(parts, list), "state.json: bad parts")
    for i, part in enumerate(parts):
        _require(isinstance(part, dict) and part.get("index") == i and set(part) - {"index"} <= set(splits),
                 f"state.json: bad part {i}")
        for split in set(part) - {"index"}:
            spooled = part[split]
            _require(isinstance(spooled, dict) and _count(spooled.get("documents")) and _count(spooled.get("bytes"))
                     and _digests(spooled.get("files"), {"txt", "spans"}, exact=True), f"state.json: bad part {i}")
    made = state.get("shards")
    _require(isinstance(made, dict) and set(made) == set(splits), "state.json: bad shards")
    for split, entries in made.items():
        _require(isinstance(entries, dict), "state.json: bad shards")
        for index, entry in entries.items():
            _require(index.isdigit() and valid_shard(entry, split, int(index)),
                     f"state.json: bad shard {split} {index}")
    stats = state.get("filters")
    _require(isinstance(stats, list) and [s.get("name") if isinstance(s, dict) else None for s in stats] == filter_names
             and all(set(s) == set(new_stats("")) and isinstance(s["counts"], dict) for s in stats),
             "state.json: its filters are not this build's")
    saved = state.get("checkpoint")
    _require(saved is None or (isinstance(saved, dict) and isinstance(saved.get("file"), str)
                               and CHECKPOINT.fullmatch(saved["file"])), "state.json: bad checkpoint")
    _require(stage != "filter" or not parts or saved is not None,
             "state.json: filtered parts without a checkpoint of the filters")
    if stage != "filter":
        _require(state.get("split") in ("characters", "documents") and isinstance(state.get("separate_documents"), bool)
                 and isinstance(state.get("source"), dict), "state.json: bad split")
    if stage == "tokenize":
        _require(state.get("dtype") in ("uint16", "uint32") and _count(state.get("vocab_size"))
                 and (state.get("eos_id") is None or _count(state["eos_id"])), "state.json: bad vocabulary")
        _require(valid_files(state.get("tokenizer")), "state.json: bad tokenizer")
    return state


def valid_shard(entry, split: str, index: int | None = None) -> bool:
    """Whether ``entry`` is a token shard's index entry as the build writes it (names it may open)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
        return False
    name = entry["name"]
    prefix, _, number = name.rpartition("-")
    if prefix != split or not (number.isdigit() and len(number) == 5) or (index is not None and int(number) != index):
        return False
    return (_count(entry.get("tokens")) and _count(entry.get("documents"))
            and _digests(entry.get("files"), set(shards.SUFFIXES)))


def valid_files(files) -> bool:
    """Whether ``files`` maps relative paths inside a folder (no ``..``, not absolute) to SHA-256s."""
    return isinstance(files, dict) and all(
        isinstance(p, str) and p and not p.startswith("/") and "\\" not in p
        and all(part not in ("", ".", "..") for part in p.split("/")) and isinstance(d, str) and SHA256.fullmatch(d)
        for p, d in files.items())


def _digests(files, allowed: set[str], exact: bool = False) -> bool:
    return (isinstance(files, dict) and (set(files) == allowed if exact else set(files) <= allowed)
            and all(isinstance(d, str) and SHA256.fullmatch(d) for d in files.values()))


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _require(condition, reason: str) -> None:
    if not condition:
        raise Unusable(reason)
