"""The moe plugin passes lmlab's conformance kit for the ffn slot, with and without a capacity limit."""

import pytest

from lmlab.testing import iter_checks
from lmlab_moe.moe import MixtureOfExpertsFeedForward

OPTIONS = {"top-2": {}, "top-1-swiglu-no-limit": {"top_k": 1, "activation": "swiglu", "capacity_factor": 0}}
CHECKS = [(name, check) for name, options in OPTIONS.items()
          for check in iter_checks(MixtureOfExpertsFeedForward, options)]


@pytest.mark.parametrize("check", [c for _, c in CHECKS], ids=[f"{name}-{c.name}" for name, c in CHECKS])
def test_conformance(check):
    check()
