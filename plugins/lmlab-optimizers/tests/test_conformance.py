"""adamw passes lmlab's conformance kit for the optimizer slot, with its defaults and with the options
that change how it steps (no weight decay, the multi-tensor implementation)."""

import pytest

from lmlab.testing import iter_checks
from lmlab_optimizers.adamw import AdamW

OPTIONS = [None, {"weight_decay": 0.0}, {"foreach": True, "lr": 3e-4, "betas": (0.8, 0.99)}]
CHECKS = [(options, check) for options in OPTIONS for check in iter_checks(AdamW, options)]


@pytest.mark.parametrize("check", [c for _, c in CHECKS], ids=[f"{o or 'defaults'}-{c.name}" for o, c in CHECKS])
def test_conformance(check):
    check()
