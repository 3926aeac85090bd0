"""Conformance checks of filter plugins: what ``lmlab prepare`` relies on when it filters in workers.

``lmlab prepare`` never hands a filter instance to a worker: each worker process rebuilds every filter
from its class (pickled by reference) and its options (``lmlab.prepare.work.PluginSpec``), in a fresh
interpreter, and sees its own chunks of the corpus in whatever order the pool hands them out. So the
per-document methods (``apply``, which calls ``keep`` and ``transform``, and a corpus-level filter's
``signature``) must give the same answer for a document whatever instance, process or order computes
it. Only a corpus-level filter's ``admit`` keeps state, in the main process, and a checkpoint holds
that state through ``state_dict`` (stored without pickling by ``lmlab.prepare.checkpoint``).

The kit's :data:`DOCUMENTS` (or those a test passes) hold prose long enough for quality rules,
personal data and timestamps, junk, repeated lines, a prompt/response Record, and, in their second
half, an exact and a near copy of documents of the first half.
"""

import json
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from lmlab.api import Record, Segment, document_text
from lmlab.testing import generic
from lmlab.testing.common import Subject, fail

_PROSE = ("The committee met on Tuesday to review the harbour plans. After a long debate about costs, "
          "the members agreed to repair the northern wall first and to delay the new pier until the spring. "
          "Several fishermen asked whether the work would close the slipway, and the engineer promised that "
          "boats could still be launched at high tide. The minutes will be posted on the town website next week, "
          "and questions may be sent to the clerk before the next meeting.")
_OTHER = ("Bread rises because yeast ferments sugars and releases carbon dioxide, which the gluten network "
          "traps as small bubbles. A warm kitchen speeds this up, while a cold one slows it down and lets more "
          "flavour develop. Many bakers therefore leave their dough in the refrigerator overnight, shape it in "
          "the morning, and bake it in a very hot oven with steam so that the crust stays thin and crisp.")

#: Documents the filter checks run on unless a test passes its own; the second half repeats the first.
DOCUMENTS = (
    _PROSE + " Write to Jane Roe at jane.roe@example.org or call +1 555 123 4567 from 192.168.0.12.",
    _OTHER + " Posted on 4 March 2021 at 12:30 UTC, updated 2021-03-05T08:00:00Z.",
    "### $$$ ### 0101 0101 ###",
    "buy now\nbuy now\nbuy now\nbuy now\nbuy now\nlimited offer",
    Record.prompt_response("Summarise the note from jane.roe@example.org sent on 2021-03-04:\n",
                           "The harbour wall will be repaired first; call +1 555 123 4567 for details."),
    _PROSE + " Write to Jane Roe at jane.roe@example.org or call +1 555 123 4567 from 192.168.0.12.",
    _OTHER.replace("very hot oven", "hot oven").replace("Many bakers", "Some bakers")
    + " Posted on 4 March 2021 at 12:30 UTC, updated 2021-03-05T08:00:00Z.",
    "A short line without much in it.",
)

# Run in the child interpreter: reads the spec and documents, writes what each document gives.
_CHILD = """
import pickle, sys
with open(sys.argv[1], "rb") as f:
    sys.path[:0] = pickle.load(f)
    spec, documents = pickle.load(f)
from lmlab.api import document_text
instance = spec.build()
out = [instance.signature(document_text(d)) if instance.corpus_level else instance.apply(d) for d in documents]
with open(sys.argv[2], "wb") as f:
    pickle.dump(out, f)
"""


class FilterSubject(Subject):
    slot = "filter"

    def __init__(self, plugin, options=None, *, documents=None, **settings):
        super().__init__(plugin, options, **settings)
        self.documents = list(DOCUMENTS if documents is None else documents)
        self.name = getattr(self.cls, "name", "") or self.cls.__name__


def _outputs(instance, documents: list) -> list:
    """What a worker computes for each document: its signature (corpus-level) or ``apply``'s result."""
    if instance.corpus_level:
        return [instance.signature(document_text(doc)) for doc in documents]
    return [instance.apply(doc) for doc in documents]


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype \
            and np.array_equal(a, b)
    if isinstance(a, (list, tuple)) and type(a) is type(b):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and bool(a == b)


def _compare(expected: list, actual: list, subject: FilterSubject, what: str, why: str) -> None:
    method = "signature" if subject.cls.corpus_level else "apply"
    for i, (a, b) in enumerate(zip(expected, actual)):
        if not _same(a, b):
            fail(f"{method}() of document {i} gave {_short(b)} {what}, but {_short(a)} at first; {why}")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def outputs(subject: FilterSubject) -> None:
    """``apply`` returns None or a str for a plain document, None or a Record of Segments (str text,
    bool ``scored``) for a Record; a corpus-level filter's ``signature`` is picklable (it travels from
    the worker to the main process)."""
    instance = subject.plugin()
    for i, doc in enumerate(subject.documents):
        if instance.corpus_level:
            sig = instance.signature(document_text(doc))
            try:
                pickle.dumps(sig)
            except Exception as exc:
                fail(f"the signature of document {i} does not pickle ({type(exc).__name__}: {exc}); it travels "
                     "from a worker process to the main one")
            continue
        out = instance.apply(doc)
        if out is None:
            continue
        if isinstance(doc, str) and not isinstance(out, str):
            fail(f"apply() of plain document {i} returned a {type(out).__name__}, not a str or None")
        if isinstance(doc, Record):
            if not isinstance(out, Record):
                fail(f"apply() of Record {i} returned a {type(out).__name__}, not a Record or None")
            bad = [s for s in out.segments if not (isinstance(s, Segment) and isinstance(s.text, str)
                                                   and isinstance(s.scored, bool))]
            if bad:
                fail(f"apply() of Record {i} returned a segment {bad[0]!r}; segments are Segment(str, bool)")


def per_document(subject: FilterSubject) -> None:
    """Per-document results depend on the document and the options only: one instance gives the same
    results on a second pass over the documents, and a fresh instance that sees them in reverse order
    gives the same result for each (each worker has its own instance and its own chunks of the corpus;
    state kept between documents, a "seen" set in ``keep``, silently depends on the chunking)."""
    instance = subject.plugin()
    first = _outputs(instance, subject.documents)
    _compare(first, _outputs(instance, subject.documents), subject, "on a second pass of the same instance",
             "per-document methods must not keep state from one document to the next (corpus_level filters "
             "compare documents, in admit)")
    backwards = _outputs(subject.plugin(), subject.documents[::-1])[::-1]
    _compare(first, backwards, subject, "from a fresh instance that saw the documents in reverse order",
             "each worker process has its own instance and sees its own chunks of the corpus")


def worker_process(subject: FilterSubject) -> None:
    """The filter's class and options pickle as ``lmlab prepare`` sends them to a worker
    (``PluginSpec``), and the filter rebuilt from them in a fresh interpreter, with another
    ``PYTHONHASHSEED`` (Python's ``hash`` of a str differs between processes), gives the same result
    for every document as in this process."""
    from lmlab.prepare.work import PluginSpec  # the core's own envelope, so the check sends what prepare sends

    spec = PluginSpec(subject.cls, subject.name, subject.options)
    try:
        payload = pickle.dumps((spec, subject.documents))
    except Exception as exc:
        fail(f"the filter's class and options do not pickle ({type(exc).__name__}: {exc}); lmlab prepare sends "
             "them to worker processes, so the class must be importable by name and its options plain values")
    expected = _outputs(subject.plugin(), subject.documents)
    env = dict(os.environ)
    seed = "12345" if env.get("PYTHONHASHSEED") != "12345" else "54321"
    env["PYTHONHASHSEED"] = seed
    with tempfile.TemporaryDirectory(prefix="lmlab-kit-worker-") as folder:
        given, got = Path(folder) / "in.pickle", Path(folder) / "out.pickle"
        given.write_bytes(pickle.dumps([p for p in sys.path if p]) + payload)
        done = subprocess.run([sys.executable, "-c", _CHILD, str(given), str(got)], env=env,
                              capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            tail = " ".join(done.stderr.strip().splitlines()[-3:])
            fail(f"rebuilding the filter in a fresh interpreter failed: {tail}")
        actual = pickle.loads(got.read_bytes())
    _compare(expected, actual, subject, f"in a fresh interpreter (PYTHONHASHSEED={seed})",
             "a result must not depend on the process (hash() of a str, id(), unseeded randomness)")


def state_dict(subject: FilterSubject) -> None:
    """Corpus-level filters whose ``state_dict`` is not None: after ``admit`` has seen the first half of
    the documents' signatures, the checkpoint ``lmlab prepare`` writes of it (``lmlab.prepare.checkpoint``:
    NumPy arrays and JSON values, no pickle) loads into a fresh instance, which then admits exactly the
    documents of the second half (copies of the first half among them) that the original admits."""
    if not subject.cls.corpus_level:
        return  # prepare checkpoints only what admit learns
    from lmlab.prepare import checkpoint  # the core's writer and reader of filter checkpoints

    signatures = _outputs(subject.plugin(), subject.documents)
    half = len(signatures) // 2
    original = subject.plugin()
    for sig in signatures[:half]:
        original.admit(sig)
    with tempfile.TemporaryDirectory(prefix="lmlab-kit-checkpoint-") as folder:
        described = checkpoint.save(Path(folder), "filters-00000.npz", {0: (subject.name, original)}, None)
        if described is None:
            return  # state_dict None: no checkpoint, the preparation filters again from the start
        described = json.loads(json.dumps(described))  # state.json holds the description
        resumed = subject.plugin()
        checkpoint.load(Path(folder), described, {0: (subject.name, resumed)})
    for i, sig in enumerate(signatures[half:], start=half):
        expected, actual = original.admit(sig), resumed.admit(sig)
        if bool(expected) != bool(actual):
            fail(f"after loading the checkpoint of the first {half} documents, a fresh instance "
                 f"{'admits' if actual else 'drops'} document {i}, which the original "
                 f"{'admits' if expected else 'drops'}: load_state_dict does not restore what admit learnt")
        if expected is not True and expected is not False and expected != actual:  # weights (API 1.11)
            fail(f"after loading the checkpoint of the first {half} documents, a fresh instance weighs document "
                 f"{i} {actual!r}, the original {expected!r}: load_state_dict does not restore what admit learnt")
    if original.report() != resumed.report():
        fail("after the same documents, the instance resumed from a checkpoint reports other tables than the "
             "original: what report() shows must be in state_dict")


def weights(subject: FilterSubject) -> None:
    """``weigh`` (API 1.11) gives each document ``apply`` kept a number in [0, 1] that depends on the
    document and the options only: a fresh instance gives the same weights (the preparation multiplies
    the filters' weights into the document's sampling weight, in whichever worker)."""
    instance = subject.plugin()
    if instance.corpus_level:
        return
    kept = [out for out in _outputs(instance, subject.documents) if out is not None]
    first = [instance.weigh(doc) for doc in kept]
    for i, w in enumerate(first):
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0.0 <= float(w) <= 1.0:
            fail(f"weigh() of kept document {i} returned {w!r}; a weight is a number in [0, 1]")
    again = [subject.plugin().weigh(doc) for doc in kept[::-1]][::-1]
    if again != first:
        fail("weigh() gave other weights from a fresh instance that saw the documents in reverse order; a weight "
             "must depend on the document and the options only")


def report(subject: FilterSubject) -> None:
    """``report`` (API 1.12) returns a list of ``lmlab.api.Table``, from a corpus-level filter that has
    admitted the documents and from one that has seen none (a corpus the filters before it emptied),
    and the tables survive JSON, as the index and summary.json keep them."""
    from lmlab.api import Table

    instance = subject.plugin()
    fresh = instance.report()
    if instance.corpus_level:
        for sig in _outputs(subject.plugin(), subject.documents):
            verdict = instance.admit(sig)
            if not (verdict is True or verdict is False or verdict is None or (
                    isinstance(verdict, (int, float)) and 0.0 <= verdict <= 1.0)):
                fail(f"admit() returned {verdict!r}; it returns True, False or a weight in [0, 1]")
    for tables in (fresh, instance.report()):
        if not isinstance(tables, list) or not all(isinstance(t, Table) for t in tables):
            fail(f"report() returned {_short(tables)}; it returns a list of lmlab.api.Table")
        for t in tables:
            if Table.from_dict(json.loads(json.dumps(t.as_dict()))) != t:
                fail(f"the table {t.title!r} changes through JSON (its cells must be str, int, float or None)")


def shuffle_keys(subject: FilterSubject) -> None:
    """Corpus-level filters with ``shuffle_keys`` (API 1.14): the keys are a list of bytes that
    depends on the signature alone, and deciding with ``admit_among`` from an index of the admitted
    documents by key (what ``lmlab prepare --executor dask`` partitions over its workers) gives
    ``admit``'s verdicts and counts, document by document."""
    from lmlab.api import Filter

    if not subject.cls.corpus_level or subject.cls.shuffle_keys is Filter.shuffle_keys:
        return
    signatures = _outputs(subject.plugin(), subject.documents)
    alone, partitioned, index = subject.plugin(), subject.plugin(), {}
    for i, sig in enumerate(signatures):
        keys = partitioned.shuffle_keys(sig)
        if not isinstance(keys, list) or not all(isinstance(k, bytes) for k in keys) or not keys:
            fail(f"shuffle_keys() of document {i} returned {_short(keys)}; it returns a non-empty list of bytes")
        if subject.plugin().shuffle_keys(sig) != keys:
            fail(f"shuffle_keys() of document {i} differs from a fresh instance's: keys depend on the signature only")
        candidates = [c for k in dict.fromkeys(keys) for c in index.get(k, ())]
        expected, actual = alone.admit(sig), partitioned.admit_among(sig, candidates)
        if expected != actual or alone.__dict__.get("_counts") != partitioned.__dict__.get("_counts"):
            fail(f"document {i}: admit_among() with the admitted documents that share a key gave {actual!r} "
                 f"(counts {partitioned.__dict__.get('_counts')}), admit() {expected!r} (counts "
                 f"{alone.__dict__.get('_counts')}): a partitioned index would decide otherwise")
        if actual is not False and actual is not None:
            for k in keys:
                index.setdefault(k, []).append(sig)


#: name → check, in the order ``check_filter`` runs them.
CHECKS = {
    "plugin_class": generic.plugin_class,
    "outputs": outputs,
    "per_document": per_document,
    "worker_process": worker_process,
    "state_dict": state_dict,
    "weights": weights,
    "report": report,
    "shuffle_keys": shuffle_keys,
}
