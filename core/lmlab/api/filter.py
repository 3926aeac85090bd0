"""The filter slot (many-valued): data hygiene applied while ``lmlab prepare`` reads the corpus."""

from typing import Any, ClassVar

from lmlab.api.data import Document, Record, document_text
from lmlab.api.plugin import Plugin
from lmlab.api.table import Table


class Filter(Plugin):
    """Drops or rewrites documents before they are split, fitted on and tokenised.

    ``use = ["quality", "pii-scrub", "minhash-dedup"]`` applies the filters in that order to every
    document, each seeing what the previous ones left. Each filter is instantiated in every worker
    process of the preparation (and in the main process, which filters too while the workers start),
    so its per-document methods must depend only on the document and the options:

    - [keep][lmlab.api.filter.Filter.keep] decides on the whole text (of a
      [Record][lmlab.api.data.Record] too): False drops it;
    - [transform][lmlab.api.filter.Filter.transform] rewrites text, applied to each segment of a
      Record on its own;
    - [apply][lmlab.api.filter.Filter.apply] combines the two; override it only to treat Records
      differently.

    A *corpus-level* filter (near-duplicate removal) compares documents with one another, which no
    single worker can. It sets ``corpus_level = True``: instead of the three methods above,
    [signature][lmlab.api.filter.Filter.signature] then runs in the workers on each document that
    reaches the filter, and [admit][lmlab.api.filter.Filter.admit] in the main process on those
    signatures, once per document and in corpus order, returning False to drop the document. The
    instance that admits keeps whatever state it needs;
    [state_dict][lmlab.api.filter.Filter.state_dict] hands that state to the preparation's
    checkpoints and [load_state_dict][lmlab.api.filter.Filter.load_state_dict] takes it back when an
    interrupted preparation resumes. A checkpoint is never a pickle (a shared cache is writable by
    others, and unpickling runs whatever code a planted file names): the state is NumPy arrays and
    JSON values only. A corpus-level filter that does not implement them still works, but a
    preparation using it keeps no checkpoint of its filtering: interrupted there, it filters again
    from the first document.

    [count][lmlab.api.filter.Filter.count] adds to counters reported beside the filter's documents
    and characters kept and dropped (``summary.json``'s ``data_filters``): which rule dropped a
    document, what was masked.
    """

    slot = "filter"
    corpus_level: ClassVar[bool] = False
    """True for a filter that compares documents with one another
    ([signature][lmlab.api.filter.Filter.signature] and [admit][lmlab.api.filter.Filter.admit]);
    its [keep][lmlab.api.filter.Filter.keep], [transform][lmlab.api.filter.Filter.transform] and
    [apply][lmlab.api.filter.Filter.apply] are never called."""

    def keep(self, text: str) -> bool:
        """Whether to keep a document, from its whole text (a Record's segments joined). Runs in a
        worker, through the default [apply][lmlab.api.filter.Filter.apply]. Default: always."""
        return True

    def transform(self, text: str) -> str:
        """The text rewritten (a segment of a Record, or a whole plain document). Runs in a worker,
        through the default [apply][lmlab.api.filter.Filter.apply], on documents
        [keep][lmlab.api.filter.Filter.keep] kept. Default: unchanged."""
        return text

    def apply(self, doc: Document) -> Document | None:
        """The document, rewritten, or None to drop it.

        Runs in a worker process, once per document that reached this filter, for filters that
        are not corpus-level. The default drops what [keep][lmlab.api.filter.Filter.keep] refuses
        and passes the text (each segment of a Record) through
        [transform][lmlab.api.filter.Filter.transform].

        Args:
            doc: Plain text, or a [Record][lmlab.api.data.Record].

        Returns:
            A document of the same kind (a Record keeps its segments' ``scored`` flags), or None.
        """
        if not self.keep(document_text(doc)):
            return None
        return doc.map_text(self.transform) if isinstance(doc, Record) else self.transform(doc)

    def weigh(self, doc: Document) -> float:
        """How much training should draw from a kept document, in [0, 1] (API 1.11): down-weighting
        instead of dropping (a passage scored as biased, code with a risky comment).

        Runs in a worker, once per document this filter kept, on what its
        [apply][lmlab.api.filter.Filter.apply] returned. A document's weight is the product of every
        filter's; ``lmlab prepare`` stores it beside the shards, and training draws windows (or
        documents) with probability proportional to it. Default 1.0: every kept document counts fully.
        Corpus-level filters weigh in [admit][lmlab.api.filter.Filter.admit] instead.
        """
        return 1.0

    def signature(self, text: str) -> Any:
        """Corpus-level filters: what [admit][lmlab.api.filter.Filter.admit] needs of a document (a
        hash, a MinHash). Runs in a worker on the document's whole text as the filters before this
        one left it; the value travels to the main process, so keep it small and picklable."""
        return None

    def admit(self, signature: Any) -> bool | float:
        """Corpus-level filters: whether to keep the document with this signature, given every
        document admitted before it. Runs in the main process, in corpus order, once for each
        document that the filters before this one kept. A float in [0, 1] (API 1.11) keeps the
        document with that sampling weight (see [weigh][lmlab.api.filter.Filter.weigh]); 0.0 keeps it
        with no chance of being drawn, False drops it."""
        return True

    def shuffle_keys(self, signature: Any) -> list[bytes] | None:
        """Corpus-level filters whose [admit][lmlab.api.filter.Filter.admit] compares a document only
        with the earlier admitted documents that share a key with it (API 1.14): those keys (an exact
        hash; the bands of a MinHash under locality-sensitive hashing). A preparation on a cluster
        (``lmlab prepare --executor dask``) then partitions the index of admitted documents by key
        over the workers instead of keeping it in one process, and decides with
        [admit_among][lmlab.api.filter.Filter.admit_among]. Pure: a function of the signature and the
        options. Default: None, the filter decides in one process with ``admit``."""
        return None

    def admit_among(self, signature: Any, candidates: list) -> bool | float:
        """Corpus-level filters with [shuffle_keys][lmlab.api.filter.Filter.shuffle_keys]: the verdict
        [admit][lmlab.api.filter.Filter.admit] would give, where ``candidates`` are the signatures of
        every earlier admitted document that shares at least one key with this one (in no particular
        order), and the index of admitted documents is kept by the caller, not by this instance.
        Count as ``admit`` would (API 1.14)."""
        raise NotImplementedError(f"{type(self).__name__} has shuffle_keys but no admit_among")

    def state_dict(self) -> dict | None:
        """Corpus-level filters: what [admit][lmlab.api.filter.Filter.admit] has learnt so far, called
        in the main process at each checkpoint of the preparation. A dict (string keys) whose values
        are NumPy arrays (any dtype but ``object``) or JSON values (str, int, float, bool, None, and
        lists and dicts of those, arrays inside them too); a checkpoint stores it without pickling.
        Default: None, "this filter cannot be checkpointed": the preparation then restarts its
        filtering from the first document when interrupted."""
        return None

    def load_state_dict(self, state: dict) -> None:
        """Corpus-level filters: take back what [state_dict][lmlab.api.filter.Filter.state_dict]
        returned, on a fresh instance, before [admit][lmlab.api.filter.Filter.admit] sees the
        documents after the checkpoint; afterwards ``admit`` decides as the instance that saved it
        would have. Raise ``ValueError`` for a state that does not fit (the preparation then starts
        over). Called only when [state_dict][lmlab.api.filter.Filter.state_dict] returned a dict."""
        raise NotImplementedError(f"{type(self).__name__} returns a state_dict but cannot load one")

    def report(self) -> list[Table]:
        """Corpus-level filters: tables about the corpus as this filter saw and left it (API 1.12), such
        as which associations down-weighting weakened. Called once in the main process, on the instance
        that admitted every document, after the last one (so what it reports must be in its
        [state_dict][lmlab.api.filter.Filter.state_dict] to survive a resumed preparation).
        ``lmlab prepare`` prints each table under the filter's line, and ``summary.json``'s
        ``data_filters.<name>.tables`` keeps them. Default: none."""
        return []

    def count(self, what: str, n: int = 1) -> None:
        """Add ``n`` to the counter ``what`` of this filter's report; call it from the per-document
        methods (``keep``, ``transform``, ``apply``, ``signature``, ``admit``). Counts made in
        workers and in the main process are summed."""
        counts = self.__dict__.setdefault("_counts", {})
        counts[what] = counts.get(what, 0) + n
