"""greedy and sample pass lmlab's conformance kit for the decoding slot: at their defaults, and sample
also at options that shape its draw (the kit makes it greedy with top_k = 1 where it needs to)."""

import pytest

from lmlab.testing.decoding import check_decoding
from lmlab_decoding.greedy import GreedyDecoder
from lmlab_decoding.sample import SamplingDecoder

CASES = [
    (GreedyDecoder, None),
    (SamplingDecoder, None),
    (SamplingDecoder, {"temperature": 0.7, "top_k": 5, "top_p": 0.9}),
    (SamplingDecoder, {"temperature": 1e-4}),
]


@pytest.mark.parametrize("plugin, options", CASES, ids=[f"{p.__name__}-{o}" for p, o in CASES])
def test_decoder_conforms(plugin, options):
    check_decoding(plugin, options)
