"""The corpus as training sees it: the prepared token shards, memory-mapped, and the fitted tokenizer.

``load_tokens(variant)`` opens the variant's entry of the token cache, running ``lmlab prepare``'s
pipeline (:mod:`lmlab.prepare.pipeline`) first when the entry is missing. The cache key hashes the
data (its fingerprint), the tokenizer, the filters and all their options, so every variant and run
that shares them re-uses one copy; a variant that changes only the model or the optimizer never
re-tokenises.
"""

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from lmlab.api import TokenSplit
from lmlab.prepare import entry, pipeline, shards


@dataclass
class TokenData:
    """Token ids of each split as a 1-D array-like (the memmap itself when the split is one shard,
    else a :class:`~lmlab.prepare.shards.ShardedTokens`), and the loss masks of corpora with Records:
    uint8, 1 where a prompt-masked objective scores the token (None: every token is scored)."""

    train: np.ndarray
    val: np.ndarray
    tokenizer: object  # the fitted lmlab.api.Tokenizer
    directory: Path
    train_mask: np.ndarray | None = None
    val_mask: np.ndarray | None = None
    index: dict = field(default_factory=dict)  # index.json

    def document_starts(self, split: str) -> np.ndarray:
        """(n_documents,) int64 offset of each document's first token in the split's array."""
        starts, offset = [], 0
        for shard in self.index["shards"][split]:
            starts.append(np.fromfile(self.directory / f"{shard['name']}.docs", dtype="<u8").astype(np.int64) + offset)
            offset += shard["tokens"]
        return np.concatenate(starts) if starts else np.zeros(0, np.int64)

    def document_weights(self, split: str) -> np.ndarray | None:
        """(n_documents,) float32: each document's sampling weight (the product of the filters'), or None
        when every document weighs 1."""
        if not self.index.get("weighted"):
            return None
        return np.concatenate([np.fromfile(self.directory / f"{shard['name']}.weights", dtype="<f4")
                               for shard in self.index["shards"][split]] or [np.zeros(0, np.float32)])

    def split(self, name: str) -> TokenSplit:
        """One split as an objective sees it (``Objective.token_labels``)."""
        tokens, mask = (self.train, self.train_mask) if name == "train" else (self.val, self.val_mask)
        return TokenSplit(name=name, tokens=tokens, loss_mask=mask, document_starts=self.document_starts(name),
                          tokenizer=self.tokenizer)

    def report(self) -> dict:
        """What a run's summary records of its data: documents and tokens per split, the source's
        counts, and each filter's documents and characters kept and dropped."""
        out = {"data": {"documents": self.index["documents"], "tokens": self.index["tokens"],
                        "source": self.index["source"], "cache": self.directory.name}}
        weights = self.document_weights("train")
        if weights is not None:  # what training draws from: each document's tokens times its weight
            sizes = np.diff(np.append(self.document_starts("train"), len(self.train)))
            out["data"]["effective_train_tokens"] = float((weights.astype(np.float64) * sizes).sum())
        if self.index["filters"]:
            out["data_filters"] = self.index["filters"]
        return out


def load_tokens(variant, root: Path | None = None, workers: int | None = None, tokenizer=None) -> TokenData:
    """Token arrays for the variant's data, filters and tokenizer, from the cache or built into it.
    ``tokenizer``: the variant's tokenizer instance to fit (or load) rather than a new one."""
    return open_prepared(variant, pipeline.prepare_corpus(variant, root, workers=workers, tokenizer=tokenizer),
                         tokenizer)


def open_prepared(variant, directory: Path, tokenizer=None) -> TokenData:
    """The cache entry at ``directory`` (``<cache>/tokens/<key>``, as :func:`pipeline.prepare_corpus`
    returns it), verified against its checksums first (once per process); a damaged entry is rebuilt.
    Its fitted tokenizer is loaded into ``tokenizer`` (a new instance of the variant's by default)."""
    try:
        index = entry.index(directory)
    except entry.Damaged:
        # prepare_corpus checks again under the builders' lock, says what is wrong, and rebuilds
        directory = pipeline.prepare_corpus(variant, root=directory.parent.parent, key=directory.name,
                                            tokenizer=tokenizer)
        index = entry.index(directory)
    tokenizer = tokenizer if tokenizer is not None else variant.instantiate("tokenizer")
    tokenizer.load(directory / "tokenizer")
    arrays = {split: shards.open_split(directory, index["shards"][split], "bin", index["dtype"])
              for split in ("train", "val")}
    masks = {split: shards.open_split(directory, index["shards"][split], "mask", np.uint8) if index["masked"]
             else None for split in ("train", "val")}
    return TokenData(arrays["train"], arrays["val"], tokenizer, directory, masks["train"], masks["val"], index)
