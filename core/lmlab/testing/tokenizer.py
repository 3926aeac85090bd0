"""Conformance checks of tokenizer plugins: what ``lmlab prepare``, training and generation rely on.

The tokenizer is fitted as ``lmlab prepare`` fits it: ``fit_documents`` on a one-pass stream of the
training documents (the kit's small :data:`CORPUS`, or the ``corpus`` a test passes), with a scratch
folder that is deleted before the tokenizer is used. Workers then rebuild it from its class and
options and ``load`` the folder it was saved to; the ids and names it reports end up in JSON files
(the token cache's ``state.json``), so they must be plain ints.

Round trips use text made only of the corpus's characters, rearranged (lines in another order, the
whole alphabet in one string, words joined by runs of spaces), so that a tokenizer that learnt its
alphabet from the corpus can encode all of it and memorising the corpus is not enough.
"""

import tempfile
from pathlib import Path

import numpy as np

from lmlab.testing import generic
from lmlab.testing.common import Subject, fail

#: Documents the kit fits a tokenizer on unless a test passes its own ``corpus``: prose with digits,
#: punctuation, newlines, runs of spaces and a few characters outside ASCII.
CORPUS = (
    "The river rose in the night, and by morning the lower fields were under water.\n"
    "Nobody in the village had seen it climb so fast since the spring of 1987.\n",
    "She counted the boats twice: 14 on the shore, 3 more tied to the old mill.\n"
    "\"Bring the ropes,\" she said, \"and the lamps, too; we may need them before noon.\"\n",
    "A café stood at the corner — closed now, its chairs stacked against the glass.\n"
    "Its owner, Mr. Dupré, had left for the hills with his two dogs & a cart of bread.\n",
    "By evening the water began to fall.  Children ran along the wall, shouting;\n"
    "their parents watched, quiet, tired, relieved (and a little afraid of tomorrow).\n",
    "Weeks later, a surveyor measured the mark on the church door: 2.35 m above the road.\n"
    "He wrote the number in his notebook, underlined it, and walked on without a word.\n",
)


class TokenizerSubject(Subject):
    slot = "tokenizer"

    def __init__(self, plugin, options=None, *, corpus=None, **settings):
        super().__init__(plugin, options, **settings)
        self.corpus = list(CORPUS if corpus is None else ([corpus] if isinstance(corpus, str) else corpus))

    def fitted(self, corpus: list[str] | None = None):
        """A fresh instance fitted as ``lmlab prepare`` fits it."""
        tokenizer = self.plugin()
        with tempfile.TemporaryDirectory(prefix="lmlab-kit-fit-") as scratch:
            tokenizer.fit_documents(iter(self.corpus if corpus is None else corpus), Path(scratch))
        return tokenizer

    def texts(self) -> dict[str, str]:
        """what the text is → the text: the corpus's characters in new arrangements."""
        whole = "\n".join(self.corpus)
        lines = [line for line in whole.split("\n") if line]
        texts = {f"corpus document {i}": doc for i, doc in enumerate(self.corpus)}
        texts["the corpus's lines in reverse order"] = "\n".join(reversed(lines))
        texts["every character of the corpus, sorted"] = "".join(sorted(set(whole)))
        texts["the corpus's words joined by runs of spaces"] = "   ".join(whole.split()[:40])
        texts["the empty string"] = ""
        return texts


def _ids(tokenizer, text: str, what: str) -> list[int]:
    """``encode(text)`` as a list of ints, failing on anything ``lmlab prepare`` could not store."""
    raw = tokenizer.encode(text)
    try:
        array = np.asarray(raw)
    except Exception:
        array = None
    if array is None or array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        fail(f"encode({what}) returned {type(raw).__name__} {str(raw)[:60]}, not a sequence of integer ids")
    return array.astype(np.int64).tolist()


def _plain_int(value, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        # lmlab prepare writes it to state.json: json refuses a NumPy integer, and True is not an id.
        fail(f"{what} is {value!r} of type {type(value).__name__}, not a plain int")


def round_trip(subject: TokenizerSubject) -> None:
    """After fitting on the corpus, ``decode(encode(text)) == text`` for text made of the corpus's
    characters: each corpus document, its lines in reverse order, its sorted alphabet, its words joined
    by runs of spaces and the empty string (whose encoding is empty)."""
    tokenizer = subject.fitted()
    for what, text in subject.texts().items():
        ids = _ids(tokenizer, text, what)
        back = tokenizer.decode(ids)
        if back != text:
            at = next((i for i, (a, b) in enumerate(zip(back, text)) if a != b), min(len(back), len(text)))
            fail(f"decode(encode({what})) differs from the text from character {at}: "
                 f"{back[max(0, at - 10):at + 20]!r} instead of {text[max(0, at - 10):at + 20]!r} "
                 f"({len(back)} characters instead of {len(text)})")
        if not text and ids:
            fail(f"encode('') returned {len(ids)} ids; the empty text has none")


def vocabulary(subject: TokenizerSubject) -> None:
    """``vocab_size`` is a plain positive int; every id ``encode`` returns lies in [0, vocab_size) and is
    never ``pad_id`` (padding must be told apart from text); every id below ``vocab_size`` decodes to a
    str (generation decodes whatever the model samples)."""
    tokenizer = subject.fitted()
    size = tokenizer.vocab_size
    _plain_int(size, "vocab_size")
    if size <= 0:
        fail(f"vocab_size is {size}")
    pad = tokenizer.pad_id
    for what, text in subject.texts().items():
        ids = _ids(tokenizer, text, what)
        if ids and (min(ids) < 0 or max(ids) >= size):
            bad = min(ids) if min(ids) < 0 else max(ids)
            fail(f"encode({what}) returned id {bad}, outside [0, vocab_size = {size})")
        if pad is not None and pad in ids:
            fail(f"encode({what}) returned pad_id {pad}; pad_id is reserved for padding, which encode never "
                 "produces")
    decoded = tokenizer.decode(list(range(size)))
    if not isinstance(decoded, str):
        fail(f"decode(range(vocab_size)) returned {type(decoded).__name__}, not str")


def special_ids(subject: TokenizerSubject) -> None:
    """``eos_id``, ``pad_id`` and ``special_id(name)`` for "eos", "pad", "unk", "bos" and "mask" are
    None or plain ints in [0, vocab_size); ``special_id("eos")`` is ``eos_id`` and
    ``special_id("pad")`` is ``pad_id`` (their fixed meaning); the pad id differs from the eos and mask
    ids, and the mask id from every other; ``special_id`` of a name the tokenizer lacks is None."""
    tokenizer = subject.fitted()
    size = tokenizer.vocab_size
    named = {"eos_id": tokenizer.eos_id, "pad_id": tokenizer.pad_id}
    named.update({f"special_id({name!r})": tokenizer.special_id(name) for name in ("eos", "pad", "unk", "bos", "mask")})
    for what, value in named.items():
        if value is None:
            continue
        _plain_int(value, what)
        if not 0 <= value < size:
            fail(f"{what} is {value}, outside [0, vocab_size = {size})")
    for name in ("eos", "pad"):
        if named[f"special_id({name!r})"] != named[f"{name}_id"]:
            fail(f"special_id({name!r}) is {named[f'special_id({name!r})']!r} but {name}_id is "
                 f"{named[f'{name}_id']!r}; the name {name!r} means {name}_id")
    ids = {name: named[f"special_id({name!r})"] for name in ("eos", "pad", "unk", "bos", "mask")}
    for one, others in (("pad", ("eos", "mask")), ("mask", ("eos", "pad", "unk", "bos"))):
        for other in others:
            if ids[one] is not None and ids[one] == ids[other]:
                fail(f"the {one} id and the {other} id are both {ids[one]}; an objective could not tell "
                     f"{one} tokens from {other} tokens")
    unknown = tokenizer.special_id("no-such-special-token")
    if unknown is not None:
        fail(f"special_id('no-such-special-token') is {unknown!r}, not None")


def save_load(subject: TokenizerSubject) -> None:
    """``save`` into an empty folder, then ``load`` into a fresh instance with the same options (as each
    worker process does): the same ``vocab_size``, special ids, ``fingerprint()``, ids for every
    round-trip text and decoded text for them."""
    tokenizer = subject.fitted()
    with tempfile.TemporaryDirectory(prefix="lmlab-kit-tokenizer-") as folder:
        tokenizer.save(Path(folder))
        loaded = subject.plugin()
        loaded.load(Path(folder))
    _same(tokenizer, loaded, subject, "the tokenizer loaded from what it saved")


def fit_determinism(subject: TokenizerSubject) -> None:
    """Two instances fitted on the same corpus agree (the token cache is keyed on the data and the
    options, not on the fitted state): same ``vocab_size``, special ids, ``fingerprint()`` and ids. The
    fingerprint is a str, computed before fitting too (the core keys the cache on a fresh instance's)
    and the same for two fresh instances."""
    fresh = [subject.plugin().fingerprint() for _ in range(2)]
    if not isinstance(fresh[0], str):
        fail(f"fingerprint() of a fresh instance is {type(fresh[0]).__name__}, not str")
    if fresh[0] != fresh[1]:
        fail(f"two fresh instances with the same options have different fingerprints ({fresh[0]!r}, {fresh[1]!r}); "
             "the token cache would never be reused")
    _same(subject.fitted(), subject.fitted(), subject, "a second instance fitted on the same corpus")


def _same(reference, other, subject: TokenizerSubject, what: str) -> None:
    for name in ("vocab_size", "eos_id", "pad_id"):
        if getattr(other, name) != getattr(reference, name):
            fail(f"{what} has {name} {getattr(other, name)!r}, not {getattr(reference, name)!r}")
    for name in ("unk", "bos", "mask"):
        if other.special_id(name) != reference.special_id(name):
            fail(f"{what} has special_id({name!r}) {other.special_id(name)!r}, not {reference.special_id(name)!r}")
    theirs, ours = other.fingerprint(), reference.fingerprint()
    if theirs != ours:
        fail(f"{what} has fingerprint {theirs!r}, not {ours!r}")
    for text_name, text in subject.texts().items():
        expected = _ids(reference, text, text_name)
        actual = _ids(other, text, text_name)
        if actual != expected:
            at = next((i for i, (a, b) in enumerate(zip(actual, expected)) if a != b), min(len(actual), len(expected)))
            fail(f"{what} encodes {text_name} differently from id {at}: {actual[at:at + 5]} instead of "
                 f"{expected[at:at + 5]}")
        if other.decode(expected) != reference.decode(expected):
            fail(f"{what} decodes the ids of {text_name} to different text")


#: name → check, in the order ``check_tokenizer`` runs them.
CHECKS = {
    "plugin_class": generic.plugin_class,
    "round_trip": round_trip,
    "vocabulary": vocabulary,
    "special_ids": special_ids,
    "save_load": save_load,
    "fit_determinism": fit_determinism,
}
