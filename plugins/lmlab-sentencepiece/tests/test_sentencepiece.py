from pathlib import Path

import pytest

from lmlab.api import UserError
from lmlab_sentencepiece.sentencepiece import MODEL_FILE, SentencePieceTokenizer

SHAKESPEARE = Path(__file__).resolve().parents[3] / "data" / "tinyshakespeare.txt"
pytestmark = pytest.mark.skipif(not SHAKESPEARE.exists(), reason="needs data/tinyshakespeare.txt")


@pytest.fixture(scope="module")
def text():
    return SHAKESPEARE.read_text(encoding="utf-8")[:50_000]


def fitted(text, tmp_path, **options):
    tok = SentencePieceTokenizer(SentencePieceTokenizer.Options(**options))
    tok.fit(text, tmp_path)
    return tok


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_decode_inverts_encode_exactly_including_newlines_and_spaces(text, tmp_path, model_type):
    tok = fitted(text, tmp_path, model_type=model_type, vocab_size=512)
    assert tok.decode(tok.encode(text)) == text
    tricky = "\n\nKING:  two  spaces \n trailing \n\n"
    assert tok.decode(tok.encode(tricky)) == tricky
    assert len(tok.encode(text)) < len(text) / 2  # it learned subwords, not characters


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_vocab_size_is_honoured(text, tmp_path, model_type):
    tok = fitted(text, tmp_path, model_type=model_type, vocab_size=300)
    assert tok.vocab_size == 300
    assert max(tok.encode(text)) < 300


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_fitting_twice_gives_the_same_model(text, tmp_path, model_type):
    a = fitted(text, tmp_path, model_type=model_type, vocab_size=400)
    b = fitted(text, tmp_path, model_type=model_type, vocab_size=400)
    assert a.model_bytes == b.model_bytes


def test_save_then_load_encodes_identically(text, tmp_path):
    tok = fitted(text, tmp_path, vocab_size=400)
    tok.save(tmp_path)
    assert (tmp_path / MODEL_FILE).exists()
    fresh = SentencePieceTokenizer(tok.options)
    fresh.load(tmp_path)
    assert fresh.encode(text) == tok.encode(text)
    assert fresh.decode(tok.encode(text)) == text


def test_byte_fallback_round_trips_characters_never_seen(text, tmp_path):
    tok = fitted(text, tmp_path, vocab_size=400, byte_fallback=True)
    unseen = "naïve — 🙂\n"
    assert tok.decode(tok.encode(unseen)) == unseen
    plain = fitted(text, tmp_path, vocab_size=400)
    assert plain.decode(plain.encode(unseen)) != unseen  # without it, unseen characters become <unk>


def test_vocab_too_large_for_the_corpus_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="vocab_size"):
        fitted("to be or not to be\n" * 10, tmp_path, vocab_size=5000)


def test_eos_id_is_a_special_piece_encode_never_emits(text, tmp_path):
    tok = fitted(text, tmp_path, vocab_size=400)
    assert tok.eos_id is not None and tok.eos_id not in tok.encode(text)


def test_vocab_size_below_eight_is_refused():
    with pytest.raises(ValueError, match="vocab_size"):
        SentencePieceTokenizer.Options(vocab_size=4)
