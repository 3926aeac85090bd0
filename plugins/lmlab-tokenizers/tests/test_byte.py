import numpy as np

from lmlab_tokenizers.byte import ByteTokenizer

TEXT = "Hello, world!\nÆsop — naïve café 🙂\n"


def test_ids_are_the_utf8_bytes():
    tok = ByteTokenizer()
    assert tok.vocab_size == 256
    assert list(tok.encode(TEXT)) == list(TEXT.encode("utf-8"))


def test_decode_inverts_encode():
    tok = ByteTokenizer()
    assert tok.decode(tok.encode(TEXT)) == TEXT


def test_invalid_utf8_decodes_with_replacement_characters():
    tok = ByteTokenizer()
    ids = tok.encode("é")[:1]  # half of a two-byte character
    assert tok.decode(np.concatenate([tok.encode("a"), ids])) == "a\ufffd"


def test_save_and_load_need_no_state(tmp_path):
    tok = ByteTokenizer()
    tok.fit("abc", tmp_path)
    tok.save(tmp_path)
    fresh = ByteTokenizer()
    fresh.load(tmp_path)
    assert fresh.decode(tok.encode(TEXT)) == TEXT
