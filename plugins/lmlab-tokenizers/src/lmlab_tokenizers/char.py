"""Character-level tokenizer: one token per distinct character of the training text.

This is the tokenizer of nanoGPT's ``shakespeare_char`` (and of Karpathy's char-rnn): the
vocabulary is ``sorted(set(text))``, ``stoi[ch]`` is a character's index in it and ``itos`` the
inverse. Encoding is vectorised: the text becomes an array of Unicode code points (its UTF-32
bytes) and each code point is looked up in the sorted vocabulary with a binary search, so a 1 MB
text encodes in tens of milliseconds instead of a Python loop over characters.
"""

import json
from pathlib import Path
from typing import Iterable, Literal, Sequence

import numpy as np

from lmlab.api import Field, Options, Tokenizer, UserError

VOCAB_FILE = "char_vocab.json"


class CharOptions(Options):
    unknown: Literal["error", "skip"] = Field(
        "error", help='characters not seen by fit: "error" stops with a message, "skip" drops them')


def code_points(text: str) -> np.ndarray:
    """text → (len(text),) uint32 Unicode code points, without a Python loop."""
    return np.frombuffer(text.encode("utf-32-le"), dtype="<u4")


def as_ids(ids: Sequence[int]) -> np.ndarray:
    """Token ids from a list, a numpy array or a (CPU or GPU) tensor → int64 numpy array."""
    if hasattr(ids, "tolist") and not isinstance(ids, np.ndarray):
        ids = ids.tolist()
    return np.asarray(ids, dtype=np.int64).reshape(-1)


class CharTokenizer(Tokenizer):
    Options = CharOptions
    api = ">=1.3,<2"  # fit_documents

    def __init__(self, options: CharOptions | None = None):
        super().__init__(options)
        self.codes: np.ndarray | None = None  # (V,) sorted code points; token id = index

    def fit(self, text: str, workdir: Path) -> None:
        self.codes = np.unique(code_points(text))

    def fit_documents(self, documents: Iterable[str], workdir: Path) -> None:
        # The union of each document's characters: the same vocabulary as fit() on their
        # concatenation, without holding the corpus in memory.
        seen: set[int] = set()
        for doc in documents:
            seen.update(np.unique(code_points(doc)).tolist())
        self.codes = np.array(sorted(seen), dtype=np.uint32)

    @property
    def chars(self) -> list[str]:
        """nanoGPT's ``itos``: the vocabulary, in id order."""
        return [chr(c) for c in self._fitted()]

    @property
    def vocab_size(self) -> int:
        return len(self._fitted())

    def encode(self, text: str) -> np.ndarray:
        codes, cps = self._fitted(), code_points(text)
        ids = np.searchsorted(codes, cps)  # (N,) position each code point would take in the vocab
        known = codes[np.minimum(ids, len(codes) - 1)] == cps
        if known.all():
            return ids
        if self.options.unknown == "skip":
            return ids[known]
        first = chr(cps[np.argmin(known)])
        raise UserError(
            f"character {first!r} (U+{ord(first):04X}) was not in the text the char tokenizer was fitted on; "
            'fit it on a larger corpus that contains it, or set unknown = "skip"', key="tokenizer.unknown")

    def decode(self, ids: Sequence[int]) -> str:
        return self._fitted()[as_ids(ids)].astype("<u4").tobytes().decode("utf-32-le")

    def save(self, directory: Path) -> None:
        (Path(directory) / VOCAB_FILE).write_text(json.dumps({"chars": self.chars}), encoding="utf-8")

    def load(self, directory: Path) -> None:
        chars = json.loads((Path(directory) / VOCAB_FILE).read_text(encoding="utf-8"))["chars"]
        self.codes = np.array([ord(c) for c in chars], dtype=np.uint32)

    def _fitted(self) -> np.ndarray:
        if self.codes is None:
            raise RuntimeError("char tokenizer used before fit() or load()")
        return self.codes
