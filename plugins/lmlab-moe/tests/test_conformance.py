"""The moe plugin passes lmlab's conformance kit for the ffn slot: dropless (the default), without a
limit spelled as 0, and with a capacity limit that drops choices in training."""

import pytest

from lmlab.testing import iter_checks
from lmlab_moe.moe import MixtureOfExpertsFeedForward

OPTIONS = {
    "top-2": {},
    "top-1-swiglu-no-limit": {"top_k": 1, "activation": "swiglu", "capacity_factor": 0},
    # 4 experts of ceil(0.6 · 64 · 2 / 4) = 20 slots for the kit's 128 top-2 choices: at least 48 are
    # dropped, so training_causality sees whether a drop depends on later tokens.
    "top-2-capacity-0.6": {"capacity_factor": 0.6},
}
CHECKS = [(name, check) for name, options in OPTIONS.items()
          for check in iter_checks(MixtureOfExpertsFeedForward, options)]


@pytest.mark.parametrize("check", [c for _, c in CHECKS], ids=[f"{name}-{c.name}" for name, c in CHECKS])
def test_conformance(check):
    check()
