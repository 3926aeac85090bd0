"""Every filter of lmlab-filters passes lmlab's conformance kit for the filter slot, with its defaults and
with options that change what it matches."""

import pytest

from lmlab.testing import iter_checks
from lmlab_filters.bias_score import BiasScore
from lmlab_filters.code_sanitize import CodeSanitize
from lmlab_filters.exact_dedup import ExactDedup
from lmlab_filters.minhash_dedup import MinHashDedup
from lmlab_filters.pii_scrub import PiiScrub
from lmlab_filters.quality import Quality
from lmlab_filters.timestamp_mask import TimestampMask

PLUGINS = [
    ("exact-dedup", ExactDedup, None),
    ("exact-dedup", ExactDedup, {"lowercase": True, "collapse_whitespace": False}),
    ("minhash-dedup", MinHashDedup, None),
    ("minhash-dedup", MinHashDedup, {"num_perm": 32, "ngram": 2, "threshold": 0.5}),
    ("pii-scrub", PiiScrub, None),
    ("quality", Quality, None),
    ("quality", Quality, {"min_words": 3, "max_symbol_fraction": 0.3}),
    ("timestamp-mask", TimestampMask, None),
    ("code-sanitize", CodeSanitize, None),
    ("bias-score", BiasScore, None),
    ("bias-score", BiasScore, {"window": 3, "min_count": 1, "threshold": 0.5, "curve": [(1.0, 0.5), (2.0, 0.0)]}),
    ("code-sanitize", CodeSanitize, {"action": "mask", "whole_documents": "code", "extra_rules": {"digits": "0101"}}),
    ("code-sanitize", CodeSanitize, {"action": "drop", "whole_documents": "code", "extra_rules": {"digits": "0101"}}),
]
CHECKS = [(f"{name}{options or ''}", check) for name, cls, options in PLUGINS for check in iter_checks(cls, options)]


@pytest.mark.parametrize("check", [c for _, c in CHECKS], ids=[f"{label}-{c.name}" for label, c in CHECKS])
def test_conformance(check):
    check()
