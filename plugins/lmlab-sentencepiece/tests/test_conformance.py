"""sentencepiece passes lmlab's conformance kit for the tokenizer slot, fitted on the kit's small corpus:
BPE and unigram, and with byte fallback, a mask token and user-defined symbols. (The kit's corpus
supports a vocabulary of a hundred pieces or so, far below the default 1024.)"""

import pytest

from lmlab.testing import iter_checks
from lmlab_sentencepiece.sentencepiece import SentencePieceTokenizer

OPTIONS = [
    {"vocab_size": 120},
    {"vocab_size": 100, "model_type": "unigram"},
    {"vocab_size": 400, "byte_fallback": True, "mask_token": True, "user_defined_symbols": ["the river"],
     "split_digits": True},
]
CHECKS = [(options, check) for options in OPTIONS for check in iter_checks(SentencePieceTokenizer, options)]


@pytest.mark.parametrize("check", [c for _, c in CHECKS], ids=[f"{o}-{c.name}" for o, c in CHECKS])
def test_conformance(check):
    check()
