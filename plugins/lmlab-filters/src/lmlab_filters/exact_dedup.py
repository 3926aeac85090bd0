"""Exact deduplication: a document whose normalised text was seen before is dropped.

Corpora repeat documents verbatim (licence files, boilerplate pages, mirrors, vendored copies), and
repeated training data is memorised and wastes compute (Lee et al. 2022, "Deduplicating Training Data
Makes Language Models Better", https://arxiv.org/abs/2107.06499). Each worker hashes a document's
text after normalisation (whitespace runs collapsed, optionally lowercased) with 128-bit BLAKE2b; the
main process keeps the set of hashes seen, 16 bytes per kept document, and drops any document whose
hash is in it: the first occurrence in corpus order is kept. A checkpoint of the preparation holds
the hashes as one (n, 16) uint8 array.
"""

import hashlib

import numpy as np

from lmlab.api import Field, Filter, Options

DIGEST = 16  # bytes of each hash


class ExactDedupOptions(Options):
    collapse_whitespace: bool = Field(True, help="treat every run of whitespace as one space (and ignore it at "
                                                 "the ends)")
    lowercase: bool = Field(False, help="compare texts ignoring case")


class ExactDedup(Filter):
    """``exact-dedup``: the first copy of each text is kept."""

    Options = ExactDedupOptions
    # lmlab.api.Filter. The state methods of 1.6 are only called by a core that has them; an older one
    # checkpoints the instance as it always did.
    api = ">=1.6,<2"  # Filter.state_dict; Filter (1.3); shuffle_keys, admit_among (1.14) where the core has them
    corpus_level = True

    def __init__(self, options: ExactDedupOptions | None = None):
        super().__init__(options)
        self.seen: set[bytes] = set()

    def signature(self, text: str) -> bytes:
        if self.options.collapse_whitespace:
            text = " ".join(text.split())
        if self.options.lowercase:
            text = text.lower()
        return hashlib.blake2b(text.encode("utf-8"), digest_size=DIGEST).digest()

    def admit(self, signature: bytes) -> bool:
        if signature in self.seen:
            self.count("duplicates")
            return False
        self.seen.add(signature)
        return True

    def shuffle_keys(self, signature: bytes) -> list[bytes]:
        return [signature]  # a document meets its duplicates under its own hash

    def admit_among(self, signature: bytes, candidates: list) -> bool:
        if candidates:  # an earlier admitted document has the same hash
            self.count("duplicates")
            return False
        return True

    def state_dict(self) -> dict:
        # A set has no order to keep: admit asks only whether a hash is in it.
        return {"seen": np.frombuffer(b"".join(self.seen), dtype=np.uint8).reshape(-1, DIGEST)}

    def load_state_dict(self, state: dict) -> None:
        seen = state.get("seen")
        if not isinstance(seen, np.ndarray) or seen.dtype != np.uint8 or seen.ndim != 2 or seen.shape[1] != DIGEST:
            raise ValueError(f"exact-dedup: 'seen' must be an (n, {DIGEST}) uint8 array")
        data = seen.tobytes()
        self.seen = {data[i:i + DIGEST] for i in range(0, len(data), DIGEST)}
