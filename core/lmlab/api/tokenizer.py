"""The tokenizer slot: text ↔ token ids."""

from pathlib import Path
from typing import Sequence

from lmlab.api.plugin import Plugin


class Tokenizer(Plugin):
    """A tokenizer is fitted once on the run's training split, then saved next to the token cache.

    The core calls :meth:`fit` (training text) or :meth:`load` (a folder written by :meth:`save`)
    before any :meth:`encode`. Fitting must be deterministic: the token cache is keyed on the
    data and the tokenizer's options, not on the fitted state.
    """

    slot = "tokenizer"

    def fit(self, text: str, workdir: Path) -> None:
        """Learn the vocabulary from ``text``; ``workdir`` is scratch space. Default: nothing to learn."""

    def encode(self, text: str) -> Sequence[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    @property
    def eos_id(self) -> int | None:
        """Id that ends a document, when the tokenizer has one."""
        return None

    def save(self, directory: Path) -> None:
        """Write the fitted state into ``directory`` (which exists). Default: nothing to write."""

    def load(self, directory: Path) -> None:
        """Restore the state written by :meth:`save`."""
