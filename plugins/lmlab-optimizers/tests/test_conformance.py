"""Every optimizer of this package passes lmlab's conformance kit for the optimizer slot, with its
defaults and with the options that change how it steps (weight decay on or off, another
implementation, the 8-bit state on the kit's small matrices)."""

import pytest

from lmlab.testing import iter_checks
from lmlab_optimizers.adafactor import Adafactor
from lmlab_optimizers.adam8bit import Adam8bit
from lmlab_optimizers.adamw import AdamW
from lmlab_optimizers.lamb import LAMB
from lmlab_optimizers.lion import Lion
from lmlab_optimizers.muon import Muon
from lmlab_optimizers.sgd import SGD

SUBJECTS = [
    (AdamW, None), (AdamW, {"weight_decay": 0.0}), (AdamW, {"foreach": True, "lr": 3e-4, "betas": (0.8, 0.99)}),
    (SGD, None), (SGD, {"weight_decay": 1e-4, "nesterov": True}), (SGD, {"momentum": 0.0, "foreach": True}),
    (Adafactor, None), (Adafactor, {"weight_decay": 0.1, "foreach": True}),
    (Lion, None), (Lion, {"weight_decay": 0.0, "betas": (0.95, 0.98)}),
    (LAMB, None), (LAMB, {"weight_norm_clamp": (0.0, 10.0), "adapt_no_decay": True}), (LAMB, {"weight_decay": 0.0}),
    (Muon, None), (Muon, {"weight_decay": 0.1, "adjust_lr": "match_rms_adamw", "nesterov": False}),
    # The kit's matrices (32 × 64 at most) are below bitsandbytes' default min_8bit_size of 4096: the
    # defaults check its 32-bit path, min_8bit_size 256 its 8-bit one.
    (Adam8bit, None), (Adam8bit, {"min_8bit_size": 256}),
]
CHECKS = [(cls, options, check) for cls, options in SUBJECTS for check in iter_checks(cls, options)]


@pytest.mark.parametrize("check", [c for _, _, c in CHECKS],
                         ids=[f"{cls.__name__}-{o or 'defaults'}-{c.name}" for cls, o, c in CHECKS])
def test_conformance(check):
    if check.subject.cls is Adam8bit:
        pytest.importorskip("bitsandbytes")
    check()
