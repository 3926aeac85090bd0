from pathlib import Path

import numpy as np
import pytest

from lmlab.api import UserError
from lmlab_tokenizers.char import CharTokenizer

SHAKESPEARE = Path(__file__).resolve().parents[3] / "data" / "tinyshakespeare.txt"
TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\nÆsop — naïve café 🙂\n"


def fitted(text=TEXT, **options):
    tok = CharTokenizer(CharTokenizer.Options(**options))
    tok.fit(text, Path("."))
    return tok


def test_vocab_and_ids_match_nanogpt_shakespeare_char():
    chars = sorted(list(set(TEXT)))  # nanoGPT data/shakespeare_char/prepare.py
    stoi = {ch: i for i, ch in enumerate(chars)}
    tok = fitted()
    assert tok.chars == chars and tok.vocab_size == len(chars)
    assert list(tok.encode(TEXT)) == [stoi[c] for c in TEXT]


def test_decode_inverts_encode_including_non_ascii_and_newlines():
    tok = fitted()
    ids = tok.encode(TEXT)
    assert isinstance(ids, np.ndarray) and ids.dtype.kind == "i"
    assert tok.decode(ids) == TEXT
    assert tok.decode(ids.tolist()) == TEXT
    assert tok.encode("").size == 0 and tok.decode([]) == ""


def test_save_then_load_restores_the_same_vocabulary(tmp_path):
    tok = fitted()
    tok.save(tmp_path)
    fresh = CharTokenizer()
    fresh.load(tmp_path)
    assert fresh.chars == tok.chars
    assert np.array_equal(fresh.encode(TEXT), tok.encode(TEXT))


def test_unknown_character_is_a_user_error_naming_it():
    tok = fitted("abc")
    with pytest.raises(UserError) as err:
        tok.encode("abz")
    assert "'z'" in str(err.value) and "larger corpus" in str(err.value)


def test_unknown_skip_drops_unseen_characters():
    tok = fitted("abc", unknown="skip")
    assert tok.decode(tok.encode("zazbzcz")) == "abc"


@pytest.mark.skipif(not SHAKESPEARE.exists(), reason="needs data/tinyshakespeare.txt")
def test_tiny_shakespeare_round_trips_with_nanogpt_vocab_size():
    text = SHAKESPEARE.read_text(encoding="utf-8")
    tok = fitted(text)
    assert tok.vocab_size == 65  # nanoGPT's shakespeare_char reports "vocab size: 65"
    assert tok.decode(tok.encode(text)) == text
