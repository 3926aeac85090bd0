"""exact-dedup and minhash-dedup keep the first of each group of (near-)duplicates and every distinct
document, on planted duplicates and on the standard library's real ones (encodings/cp*.py), and decide
the same after their state went through a checkpoint (arrays, no pickles)."""

import io
import pickle
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from lmlab.testing import check_plugin_class
from lmlab_filters.exact_dedup import ExactDedup
from lmlab_filters.minhash_dedup import MinHashDedup

ENCODINGS = Path(sysconfig.get_paths()["stdlib"]) / "encodings"


def kept(f, docs: list[str]) -> list[int]:
    """Indices of the documents the corpus-level filter keeps, fed in order as the pipeline does."""
    return [i for i, doc in enumerate(docs) if f.admit(f.signature(doc))]


def random_documents(n: int, words: int = 400, seed: int = 0) -> list[list[str]]:
    rng = np.random.default_rng(seed)
    vocabulary = [f"w{i}" for i in range(5000)]
    p = 1 / np.arange(1, 5001)  # Zipf, like natural text
    return [list(rng.choice(vocabulary, size=words, p=p / p.sum())) for _ in range(n)]


@pytest.mark.parametrize("cls", [ExactDedup, MinHashDedup])
def test_meets_the_plugin_contract(cls):
    check_plugin_class(cls, "filter")


def test_exact_dedup_drops_copies_up_to_whitespace_keeping_the_first():
    docs = ["a b  c", "x", "a b c\n", "A B C", "x"]
    assert kept(ExactDedup(), docs) == [0, 1, 3]
    assert kept(ExactDedup(ExactDedup.Options(lowercase=True)), docs) == [0, 1]
    assert kept(ExactDedup(ExactDedup.Options(collapse_whitespace=False)), docs) == [0, 1, 2, 3]


def test_minhash_removes_a_document_with_a_passage_of_five_percent_of_its_words_rewritten():
    originals = random_documents(40)
    rng = np.random.default_rng(1)
    docs = [" ".join(d) for d in originals]
    for d in originals:  # each with 20 consecutive words of 400 replaced
        start = int(rng.integers(0, len(d) - 20))
        docs.append(" ".join(d[:start] + [f"new{j}" for j in range(20)] + d[start + 20:]))
    f = MinHashDedup()
    assert kept(f, docs) == list(range(40))
    assert f.__dict__["_counts"] == {"near_duplicates": 40}


def test_minhash_with_word_pairs_removes_five_percent_of_words_changed_at_random():
    originals = random_documents(30, seed=2)
    rng = np.random.default_rng(3)
    docs = [" ".join(d) for d in originals]
    for d in originals:
        changed = list(d)
        for i in rng.choice(len(d), size=len(d) // 20, replace=False):
            changed[i] = f"other{i}"
        docs.append(" ".join(changed))
    assert kept(MinHashDedup(MinHashDedup.Options(ngram=2, threshold=0.7)), docs) == list(range(30))
    # the default 5-grams see such scattered edits as different documents (similarity ~0.63)
    assert kept(MinHashDedup(), docs) == list(range(60))


def test_minhash_keeps_distinct_documents():
    docs = [" ".join(d) for d in random_documents(200, seed=4)]
    assert kept(MinHashDedup(), docs) == list(range(200))


def stored(state: dict) -> dict:
    """``state`` as a checkpoint gives it back: each array through np.save / np.load without pickles."""
    out = {}
    for name, array in state.items():
        buffer = io.BytesIO()
        np.save(buffer, array, allow_pickle=False)
        buffer.seek(0)
        out[name] = np.load(buffer, allow_pickle=False)
    return out


def test_exact_dedup_decides_the_same_after_its_state_is_saved_and_loaded():
    docs = ["a", "b", "c", "a b", "b", "d", "a", "c ", "e", "a  b"]
    original = ExactDedup()
    assert kept(original, docs[:4]) == [0, 1, 2, 3]
    state = original.state_dict()
    assert state["seen"].dtype == np.uint8 and state["seen"].shape == (4, 16)
    restored = ExactDedup()
    restored.load_state_dict(stored(state))
    rest = docs[4:]
    assert kept(restored, rest) == kept(original, rest) == [1, 4]  # "d" and "e"; the others were seen


def test_minhash_decides_the_same_after_its_state_is_saved_and_loaded():
    originals = random_documents(20, seed=5)
    docs = [" ".join(d) for d in originals[:10]]
    rng = np.random.default_rng(6)
    later = []
    for d in originals:  # near-copies of documents before and after the checkpoint, and the rest
        start = int(rng.integers(0, len(d) - 20))
        later.append(" ".join(d[:start] + [f"new{j}" for j in range(20)] + d[start + 20:]))
    later += [" ".join(d) for d in originals[10:]]
    original = MinHashDedup()
    assert kept(original, docs) == list(range(10))
    state = original.state_dict()
    assert state["signatures"].dtype == np.uint32 and state["signatures"].shape == (10, 128)
    restored = MinHashDedup()
    restored.load_state_dict(stored(state))
    decisions = kept(original, later)
    assert kept(restored, later) == decisions
    # the near-copies of the first ten go; those of the next ten stay, and their originals go
    assert decisions == list(range(10, 20))


@pytest.mark.parametrize("cls, state", [
    (ExactDedup, {"seen": np.zeros((2, 8), np.uint8)}),
    (MinHashDedup, {"signatures": np.zeros((2, 7), np.uint32)}),
    (MinHashDedup, {"signatures": np.zeros((2, 128), np.int64)}),
])
def test_a_state_of_the_wrong_shape_is_refused_with_a_value_error(cls, state):
    with pytest.raises(ValueError):
        cls().load_state_dict(state)


def test_minhash_state_survives_pickling_for_cores_before_api_1_6():
    # Those checkpoint the instance itself; the plugin's API range still admits them.
    docs = [" ".join(d) for d in random_documents(10, seed=5)]
    f = MinHashDedup()
    kept(f, docs[:5])
    restored = pickle.loads(pickle.dumps(f))
    assert kept(restored, docs) == [5, 6, 7, 8, 9]  # the first five are known to the restored index


@pytest.mark.skipif(not ENCODINGS.is_dir(), reason="no standard library sources here")
def test_minhash_finds_the_standard_librarys_near_duplicate_code_pages():
    files = sorted(ENCODINGS.glob("cp125*.py"))  # cp1250..cp1258: one template, different tables
    docs = [p.read_text(encoding="utf-8") for p in files]
    f = MinHashDedup()
    assert 1 <= len(kept(f, docs)) < len(docs)
    distinct = [ENCODINGS / "idna.py", ENCODINGS / "punycode.py", ENCODINGS / "utf_8.py", ENCODINGS / "base64_codec.py"]
    assert kept(MinHashDedup(), [p.read_text(encoding="utf-8") for p in distinct]) == [0, 1, 2, 3]
