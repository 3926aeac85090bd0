"""The tokenizer slot: text ↔ token ids."""

from pathlib import Path
from typing import Iterable, Sequence

from lmlab.api.plugin import Plugin


class Tokenizer(Plugin):
    """A tokenizer is fitted once on the run's training split, then saved next to the token cache.

    The preparation of the token cache (``lmlab prepare``, or ``lmlab run`` or another command that
    needs the tokens when the cache lacks the entry) calls, in the main process, [fit_documents][lmlab.api.tokenizer.Tokenizer.fit_documents]
    (the training documents) or, for a fine-tune with ``[init]``,
    [load][lmlab.api.tokenizer.Tokenizer.load] (the init's fitted tokenizer), then
    [save][lmlab.api.tokenizer.Tokenizer.save]. Every later user restores that state with
    [load][lmlab.api.tokenizer.Tokenizer.load] before any [encode][lmlab.api.tokenizer.Tokenizer.encode]:
    the worker processes that tokenise the corpus, each with its own instance; a run, from the
    cache entry (it saves a copy into its run folder's ``tokenizer/``); and ``lmlab generate``,
    ``eval``, ``merge`` from that copy. Fitting must be deterministic: the token cache is keyed on
    the data and the tokenizer's options (and [fingerprint][lmlab.api.tokenizer.Tokenizer.fingerprint]),
    not on the fitted state.

    A tokenizer that knows its vocabulary without fitting (bytes, a pretrained file) answers
    [vocab_size][lmlab.api.tokenizer.Tokenizer.vocab_size] on a fresh instance; ``lmlab check``
    then checks the model against the real vocabulary instead of a stand-in.
    """

    slot = "tokenizer"

    def fit(self, text: str, workdir: Path) -> None:
        """Learn the vocabulary from the whole training text at once.

        Called only by the default [fit_documents][lmlab.api.tokenizer.Tokenizer.fit_documents],
        in the main process. Default: nothing to learn.

        Args:
            text: The training split's documents joined with newlines.
            workdir: An empty scratch folder, deleted afterwards.
        """

    def fit_documents(self, documents: Iterable[str], workdir: Path) -> None:
        """Learn the vocabulary from the training split's documents, streamed in corpus order.

        ``lmlab prepare`` calls this once, in the main process, after the filters and before
        tokenising in worker processes. The default joins the documents with newlines and calls
        [fit][lmlab.api.tokenizer.Tokenizer.fit], which holds the whole training text in memory; a
        tokenizer that can learn from a stream, or from a sample of a large corpus, overrides it. A
        tokenizer that does not override [fit][lmlab.api.tokenizer.Tokenizer.fit] has nothing to
        learn, and the documents are not even read.

        Args:
            documents: The training documents after the filters, each a ``str`` (a Record's
                segments joined), read from disk one at a time.
            workdir: An empty scratch folder, deleted afterwards.
        """
        if type(self).fit is not Tokenizer.fit:
            self.fit("\n".join(documents), workdir)

    def fingerprint(self) -> str:
        """A string that changes whenever what the tokenizer reads besides its options changes (the files
        of a pretrained tokenizer it is pointed at); part of the token-cache key, so that editing such a
        file re-tokenises instead of reusing stale tokens (API 1.5). Called on an unfitted instance
        whenever the key is computed. Default: "", the options say it all."""
        return ""

    def encode(self, text: str) -> Sequence[int]:
        """Token ids of ``text``, each in ``[0, vocab_size)``.

        Called after [fit_documents][lmlab.api.tokenizer.Tokenizer.fit_documents] or
        [load][lmlab.api.tokenizer.Tokenizer.load]: in the preparation's worker processes, once per
        plain document and once per segment of a [Record][lmlab.api.data.Record] (the core places
        [eos_id][lmlab.api.tokenizer.Tokenizer.eos_id] between documents, so do not add it); on the
        prompt of ``lmlab generate``, ``lmlab eval`` and the closing sample. Must not add special
        tokens of its own around the text (a BOS), and must be a pure function of the text and the
        fitted state.

        Args:
            text: Any text, possibly empty.

        Returns:
            A sequence of ints (a list, a numpy integer array); may be empty.

        Raises:
            UserError: The text cannot be encoded (a character outside a fixed vocabulary).
        """
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        """The text of token ids, as [encode][lmlab.api.tokenizer.Tokenizer.encode]'s inverse.

        Called on generated continuations (``lmlab generate``, ``lmlab eval``, the closing sample of
        ``lmlab run``): ``ids`` may hold any id in ``[0, vocab_size)`` the model chose, in any order.

        Args:
            ids: A list of ints.

        Returns:
            The text those ids stand for.
        """
        raise NotImplementedError

    @property
    def vocab_size(self) -> int:
        """Ids run from 0 to ``vocab_size - 1``; read after fitting or loading (and on an unfitted
        instance by ``lmlab check``, where raising any exception means "not known before fitting").
        The model's embedding and head have at least this many rows."""
        raise NotImplementedError

    @property
    def eos_id(self) -> int | None:
        """Id that ends a document, when the tokenizer has one: ``lmlab prepare`` places it after every
        document of a corpus of several documents, and decoders receive it as ``eos_id`` (a row that
        emits it is finished)."""
        return None

    @property
    def pad_id(self) -> int | None:
        """Id reserved for padding, which ``encode`` never produces, when the tokenizer has one (API 1.4).
        The core does not read it (padded rows hold an arbitrary id, see
        [Windows.padding][lmlab.api.batch.Windows.padding]); the default
        [special_id][lmlab.api.tokenizer.Tokenizer.special_id] answers it for ``"pad"``."""
        return None

    def special_id(self, name: str) -> int | None:
        """The id of the tokenizer's own special token ``name`` (``"mask"`` for a [MASK] token, ...),
        when it has one (API 1.4).

        Called once per assembly for each of the objective's special tokens
        ([Objective.special_tokens][lmlab.api.objective.Objective.special_tokens]), which take this
        id; those the tokenizer lacks get ids past its vocabulary. Names with a fixed meaning:
        ``"eos"`` (= [eos_id][lmlab.api.tokenizer.Tokenizer.eos_id]), ``"pad"``
        (= [pad_id][lmlab.api.tokenizer.Tokenizer.pad_id]), ``"unk"`` (what unknown input becomes),
        ``"bos"``, ``"mask"``.

        Args:
            name: The special token's name.

        Returns:
            An id in ``[0, vocab_size)``, or None when the tokenizer has no such token. Default:
            [eos_id][lmlab.api.tokenizer.Tokenizer.eos_id] and
            [pad_id][lmlab.api.tokenizer.Tokenizer.pad_id] for ``"eos"`` and ``"pad"``, else None.
        """
        return {"eos": self.eos_id, "pad": self.pad_id}.get(name)

    def save(self, directory: Path) -> None:
        """Write the fitted state into ``directory``, an empty folder that exists.

        Called in the main process after fitting (into the cache entry's ``tokenizer/``) and by a
        run into its run folder's ``tokenizer/``. The files are checksummed; write the same bytes
        for the same state. Default: nothing to write.
        """

    def chat_template(self) -> str | None:
        """The model's own chat template (API 1.20): the Jinja source that turns a conversation
        (``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``) into the text the
        model was tuned on, as a pretrained model's tokenizer files give it (``chat_template.jinja``,
        ``tokenizer_config.json``). ``lmlab serve``'s chat completions and ``lmlab generate
        --messages`` render it in a sandbox. Default: None, no template of its own (a data plugin's
        ``chat_template`` may stand in)."""
        return None

    def save_hf(self, directory: Path) -> None:
        """Write, into the existing folder ``directory``, the files transformers' ``AutoTokenizer``
        loads as this fitted tokenizer, encoding and decoding text to the same ids (API 1.20,
        ``lmlab export --format hf``): ``tokenizer.json`` and ``tokenizer_config.json`` with the
        special tokens. Default: NotImplementedError; the export then says it wrote no tokenizer."""
        raise NotImplementedError

    def load(self, directory: Path) -> None:
        """Restore, into a fresh instance built from the same options, the state written by
        [save][lmlab.api.tokenizer.Tokenizer.save] into ``directory``.

        Called in every process that encodes or decodes: the preparation's workers, a run (from
        the cache entry), ``lmlab generate``/``eval``/``merge`` (from the run folder), and the
        preparation of a fine-tune with ``[init]`` (from the init's folder, instead of fitting).

        Raises:
            OSError: The files cannot be read. ``lmlab generate``, ``eval`` and ``merge`` report it,
                and ``ValueError``, ``KeyError`` or ``TypeError``, as an unreadable run folder's
                ``tokenizer/``.
        """
