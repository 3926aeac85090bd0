"""Conformance checks of data-source plugins: what ``lmlab prepare`` relies on when it reads the corpus.

A data source needs something to read, so its checks take the plugin's options as a manifest's
``[data]`` table would give them (a test writes a small file and passes its path). ``lmlab prepare``
consumes ``documents()`` as a stream, once per preparation and again from the start when an
interrupted one resumes; it keys the token cache on ``fingerprint()`` (of a fresh instance) and writes
``stats()`` to the cache's index and ``summary.json`` once the stream is exhausted.
"""

import json

from lmlab.api import Conversation, Message, Record, Segment
from lmlab.testing import generic
from lmlab.testing.common import Subject, fail


class DataSubject(Subject):
    slot = "data"

    def read(self, source=None) -> list:
        """Every document of one full pass of ``documents()`` (of ``source``, or a fresh instance)."""
        source = self.plugin() if source is None else source
        return list(source.documents())


def _describe(doc) -> str:
    text = repr(doc)
    return text if len(text) <= 60 else text[:57] + "..."


def documents(subject: DataSubject) -> None:
    """With the options under test, ``documents()`` yields at least one document, each a str, an
    ``lmlab.api.Record`` of Segments (str text, bool ``scored``) or an ``lmlab.api.Conversation`` of
    Messages, and only Records or Conversations when the class declares ``yields_records = True``, only
    str when it declares False."""
    declared = getattr(subject.cls, "yields_records", None)
    if declared not in (True, False, None):
        fail(f"yields_records is {declared!r}; True, False or None")
    docs = subject.read()
    if not docs:
        fail("documents() yielded nothing with these options; give the check options that name some data")
    for i, doc in enumerate(docs):
        if isinstance(doc, Record):
            bad = [s for s in doc.segments if not (isinstance(s, Segment) and isinstance(s.text, str)
                                                   and isinstance(s.scored, bool))]
            if bad:
                fail(f"document {i} is a Record with segment {bad[0]!r}; segments are Segment(str, bool)")
            if declared is False:
                fail(f"document {i} is a Record, but the class declares yields_records = False (plain text only)")
        elif isinstance(doc, Conversation):
            if not doc.messages or not all(isinstance(m, Message) for m in doc.messages):
                fail(f"document {i} is a Conversation of {doc.messages!r}; its messages are lmlab.api.Message")
            if declared is False:
                fail(f"document {i} is a Conversation, but the class declares yields_records = False (plain text "
                     "only)")
        elif isinstance(doc, str):
            if declared is True:
                fail(f"document {i} is a str, but the class declares yields_records = True (Records only); an "
                     "objective that scores parts of Records relies on it")
        else:
            fail(f"document {i} is a {type(doc).__name__} ({_describe(doc)}), not a str, lmlab.api.Record or "
                 "lmlab.api.Conversation")


def determinism(subject: DataSubject) -> None:
    """Two full passes of one instance and a pass of a fresh instance yield the same documents in the
    same order (the validation split is taken by position, and a resumed preparation reads again)."""
    source = subject.plugin()
    first = subject.read(source)
    for what, again in (("a second pass of the same instance", subject.read(source)),
                        ("a fresh instance", subject.read())):
        if len(again) != len(first):
            fail(f"{what} yielded {len(again)} documents, the first pass {len(first)}")
        for i, (a, b) in enumerate(zip(first, again)):
            if a != b:
                fail(f"{what} yielded document {i} as {_describe(b)}, the first pass as {_describe(a)}")


def stats(subject: DataSubject) -> None:
    """After a full pass, ``stats()`` is a dict of str → plain non-negative int that JSON can write, and
    the same after a second full pass of the same instance (counts restart with each pass: a resumed
    preparation reads from the start again, and must not report its skipped lines twice)."""
    source = subject.plugin()
    subject.read(source)
    first = source.stats()
    if not isinstance(first, dict):
        fail(f"stats() returned a {type(first).__name__}, not a dict")
    for key, value in first.items():
        if not isinstance(key, str) or isinstance(value, bool) or not isinstance(value, int) or value < 0:
            fail(f"stats() has {key!r}: {value!r}; counts are str → non-negative int")
    try:
        json.dumps(first)
    except (TypeError, ValueError) as exc:
        fail(f"stats() does not serialise to JSON: {exc}")
    subject.read(source)
    if source.stats() != first:
        fail(f"stats() after a second full pass is {source.stats()!r}, after the first {first!r}: counts must "
             "restart when documents() starts again")


def fingerprint(subject: DataSubject) -> None:
    """``fingerprint()`` is a non-empty str, the same for two fresh instances and unchanged by reading
    the documents (the token cache is keyed on it: a fingerprint that changes by itself never reuses
    the cache)."""
    source = subject.plugin()
    value = source.fingerprint()
    if not isinstance(value, str) or not value:
        fail(f"fingerprint() is {value!r}, not a non-empty str")
    other = subject.plugin().fingerprint()
    if other != value:
        fail(f"two fresh instances with the same options have fingerprints {value!r} and {other!r}")
    subject.read(source)
    if source.fingerprint() != value:
        fail(f"reading the documents changed fingerprint() from {value!r} to {source.fingerprint()!r}")


def parts(subject: DataSubject) -> None:
    """A source that cuts its corpus into parts (``parts``, API 1.16) cuts it so that ``documents_in``
    of each part, each read by a fresh instance as a Dask worker reads it, yields exactly what
    ``documents()`` yields, and the parts' ``stats()`` sum to the whole pass's; for pieces of one byte
    and of a gigabyte."""
    from lmlab.api import DataSource

    if subject.cls.parts is DataSource.parts:
        return
    source = subject.plugin()
    whole, counts = subject.read(source), source.stats()
    for size in (1, 1 << 30):
        cut = source.parts(size)
        if cut is None:
            continue
        docs, summed = [], {}
        for part in cut:
            reader = subject.plugin()
            docs += list(reader.documents_in(part))
            for what, n in reader.stats().items():
                summed[what] = summed.get(what, 0) + n
        if docs != whole:
            fail(f"documents_in of parts({size}) yielded {len(docs)} documents"
                 + (f", the first that differs {_describe(next(b for a, b in zip(whole, docs) if a != b))}"
                    if any(a != b for a, b in zip(whole, docs)) else "")
                 + f"; documents() yields {len(whole)}: the parts must read the same corpus in the same order")
        if summed != counts:
            fail(f"the stats() of parts({size}) sum to {summed!r}, a full pass's are {counts!r}")


#: name → check, in the order ``check_data`` runs them.
CHECKS = {
    "plugin_class": generic.plugin_class,
    "documents": documents,
    "determinism": determinism,
    "stats": stats,
    "fingerprint": fingerprint,
    "parts": parts,
}
