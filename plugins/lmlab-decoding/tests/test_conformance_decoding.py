"""The decoders pass lmlab's conformance kit for the decoding slot: at their defaults, and at options
that shape their output (the kit makes sample greedy with top_k = 1 where it needs to, and beam with
width 1, which greedy= names).

The kit's model has no kv_layout, so it runs on the core's row-at-a-time engine, which cannot rewind:
speculative decoding is checked there with the target as its own draft at temperature 0 (every draft
token accepted, nothing rewound), and without a draft (the target alone). Rejections, rewinds and
sampling are tested in test_speculative.py over the shared-cache engine.
"""

import pytest

from lmlab.testing.decoding import check_decoding
from lmlab_decoding.beam import BeamDecoder
from lmlab_decoding.greedy import GreedyDecoder
from lmlab_decoding.sample import SamplingDecoder
from lmlab_decoding.speculative import SpeculativeDecoder


class SelfDrafting(SpeculativeDecoder):
    """Speculative decoding whose draft is the target itself (the kit never calls prepare)."""

    def generate(self, model, prompt, max_new_tokens, eos_id=None, generator=None):
        self.prepare(model, {"draft": model})
        return super().generate(model, prompt, max_new_tokens, eos_id=eos_id, generator=generator)


CASES = [
    (GreedyDecoder, None, {}),
    (SamplingDecoder, None, {}),
    (SamplingDecoder, {"temperature": 0.7, "top_k": 5, "top_p": 0.9}, {}),
    (SamplingDecoder, {"temperature": 1e-4}, {}),
    (BeamDecoder, None, {"greedy": {"width": 1}}),
    # Width 1 is greedy when a prompt stops at its first finished hypothesis (early_stopping).
    (BeamDecoder, {"width": 3, "n_best": 2, "length_penalty": 1.0, "early_stopping": False},
     {"greedy": {"width": 1, "n_best": 1, "early_stopping": True}}),
    (SelfDrafting, {"draft": "the-target", "k": 3}, {}),
    (SpeculativeDecoder, {"draft": "unused"}, {}),
    (SpeculativeDecoder, {"draft": "unused", "temperature": 0.8, "top_p": 0.9}, {}),
]


@pytest.mark.parametrize("plugin, options, settings", CASES, ids=[f"{p.__name__}-{o}" for p, o, _ in CASES])
def test_decoder_conforms(plugin, options, settings):
    check_decoding(plugin, options, **settings)
