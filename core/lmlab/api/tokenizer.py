"""The tokenizer slot: text ↔ token ids."""

from pathlib import Path
from typing import Iterable, Sequence

from lmlab.api.plugin import Plugin


class Tokenizer(Plugin):
    """A tokenizer is fitted once on the run's training split, then saved next to the token cache.

    The core calls :meth:`fit_documents` (the training documents) or :meth:`load` (a folder written
    by :meth:`save`) before any :meth:`encode`. Fitting must be deterministic: the token cache is
    keyed on the data and the tokenizer's options, not on the fitted state. ``encode`` runs in worker
    processes, each with its own instance restored by :meth:`load`.
    """

    slot = "tokenizer"

    def fit(self, text: str, workdir: Path) -> None:
        """Learn the vocabulary from ``text``; ``workdir`` is scratch space. Default: nothing to learn."""

    def fit_documents(self, documents: Iterable[str], workdir: Path) -> None:
        """Learn the vocabulary from the training split's documents, streamed in corpus order.

        ``lmlab prepare`` calls this once, after the filters and before tokenising in worker
        processes. The default joins the documents with newlines and calls :meth:`fit`, which holds
        the whole training text in memory; a tokenizer that can learn from a stream, or from a sample
        of a large corpus, overrides it. A tokenizer that does not override :meth:`fit` has nothing to
        learn, and the documents are not even read.
        """
        if type(self).fit is not Tokenizer.fit:
            self.fit("\n".join(documents), workdir)

    def fingerprint(self) -> str:
        """A string that changes whenever what the tokenizer reads besides its options changes (the files
        of a pretrained tokenizer it is pointed at); part of the token-cache key, so that editing such a
        file re-tokenises instead of reusing stale tokens (API 1.5). Default: "", the options say it all."""
        return ""

    def encode(self, text: str) -> Sequence[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    @property
    def eos_id(self) -> int | None:
        """Id that ends a document, when the tokenizer has one: ``lmlab prepare`` places it after every
        document of a corpus of several documents."""
        return None

    @property
    def pad_id(self) -> int | None:
        """Id reserved for padding, which ``encode`` never produces, when the tokenizer has one (API 1.4)."""
        return None

    def special_id(self, name: str) -> int | None:
        """The id of the tokenizer's own special token ``name`` ("mask" for a [MASK] token, ...), when it
        has one (API 1.4). An objective's special tokens (``Objective.special_tokens``) take this id;
        those the tokenizer lacks get ids past its vocabulary. Names with a fixed meaning: "eos" (=
        :attr:`eos_id`), "pad" (= :attr:`pad_id`), "unk" (what unknown input becomes), "bos", "mask".
        Default: :attr:`eos_id` and :attr:`pad_id` for "eos" and "pad", else none."""
        return {"eos": self.eos_id, "pad": self.pad_id}.get(name)

    def save(self, directory: Path) -> None:
        """Write the fitted state into ``directory`` (which exists). Default: nothing to write."""

    def load(self, directory: Path) -> None:
        """Restore the state written by :meth:`save`."""
