"""char and byte pass lmlab's conformance kit for the tokenizer slot."""

import pytest

from lmlab.testing import iter_checks
from lmlab_tokenizers.byte import ByteTokenizer
from lmlab_tokenizers.char import CharTokenizer

PLUGINS = [("char", CharTokenizer, None), ("char", CharTokenizer, {"unknown": "skip"}), ("byte", ByteTokenizer, None)]
CHECKS = [(f"{name}{options or ''}", check) for name, cls, options in PLUGINS for check in iter_checks(cls, options)]


@pytest.mark.parametrize("check", [c for _, c in CHECKS], ids=[f"{label}-{c.name}" for label, c in CHECKS])
def test_conformance(check):
    check()
