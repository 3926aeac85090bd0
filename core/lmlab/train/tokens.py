"""The corpus, tokenised once into memory-mapped token arrays and cached.

The cache key hashes the data (its fingerprint), the tokenizer and both their options, so every
variant and run that shares them re-uses one copy; a variant that changes only the model or the
optimizer never re-tokenises. Entries are written to a temporary folder and renamed into place,
so concurrent runs (sweep jobs, DDP ranks) never see a half-written cache.
"""

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FORMAT = 1  # bump when the cache layout changes


@dataclass
class TokenData:
    train: np.ndarray  # (N_train,) token ids, memory-mapped
    val: np.ndarray  # (N_val,)
    tokenizer: object  # the fitted lmlab.api.Tokenizer
    directory: Path


def cache_root() -> Path:
    return Path(os.environ.get("LMLAB_CACHE", Path.home() / ".cache" / "lmlab"))


def cache_key(variant) -> str:
    data_cls, tok_cls = variant.plugins["data"], variant.plugins["tokenizer"]
    data = variant.instantiate("data")
    blob = json.dumps({
        "format": FORMAT,
        "data": [data_cls.name, data.fingerprint(), variant.manifest["data"]],
        "tokenizer": [tok_cls.name, variant.manifest["tokenizer"]],
    }, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def prepare(variant, root: Path | None = None) -> TokenData:
    """Token arrays for the variant's data and tokenizer, from the cache or built into it."""
    directory = (root or cache_root()) / "tokens" / cache_key(variant)
    if not (directory / "meta.json").is_file():
        _build(variant, directory)
    return _open(variant, directory)


def _open(variant, directory: Path) -> TokenData:
    meta = json.loads((directory / "meta.json").read_text())
    tokenizer = variant.instantiate("tokenizer")
    tokenizer.load(directory / "tokenizer")
    arrays = {split: np.memmap(directory / f"{split}.bin", dtype=meta["dtype"], mode="r",
                               shape=(meta[f"{split}_tokens"],)) for split in ("train", "val")}
    return TokenData(arrays["train"], arrays["val"], tokenizer, directory)


def _build(variant, directory: Path) -> None:
    val_fraction = variant.manifest["data"]["val_fraction"]
    docs = list(variant.instantiate("data").documents())
    train_docs, val_docs = split(docs, val_fraction)
    tokenizer = variant.instantiate("tokenizer")
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=directory.parent))
    try:
        tokenizer.fit("\n".join(train_docs), tmp)
        (tmp / "tokenizer").mkdir()
        tokenizer.save(tmp / "tokenizer")
        dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
        meta = {"format": FORMAT, "dtype": np.dtype(dtype).name, "vocab_size": tokenizer.vocab_size}
        for name, split_docs in (("train", train_docs), ("val", val_docs)):
            ids = _encode(tokenizer, split_docs, dtype)
            ids.tofile(tmp / f"{name}.bin")
            meta[f"{name}_tokens"] = int(ids.size)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        try:
            os.rename(tmp, directory)
        except OSError:
            if not (directory / "meta.json").is_file():
                raise  # not a lost race with another process building the same entry
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def split(docs: list[str], val_fraction: float) -> tuple[list[str], list[str]]:
    """The last ``val_fraction`` of the characters (one document) or of the documents (several)."""
    if not docs:
        raise ValueError("the data source yielded no documents")
    if len(docs) == 1:
        cut = int(len(docs[0]) * (1 - val_fraction))
        return [docs[0][:cut]], [docs[0][cut:]]
    cut = min(len(docs) - 1, max(1, int(len(docs) * (1 - val_fraction))))
    return docs[:cut], docs[cut:]


def _encode(tokenizer, docs: list[str], dtype) -> np.ndarray:
    eos = tokenizer.eos_id
    parts = []
    for doc in docs:
        parts.append(np.asarray(tokenizer.encode(doc), dtype=dtype))
        if eos is not None and len(docs) > 1:
            parts.append(np.array([eos], dtype=dtype))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
