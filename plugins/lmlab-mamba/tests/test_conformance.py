"""lmlab's conformance kit on ``mamba``: every contract of the attention slot (causality, cached
decoding, reorder, gradients, bf16, determinism, state_dict, torch.compile), at its defaults and with
other options."""

import pytest

from lmlab_mamba.mamba import Mamba

testing = pytest.importorskip("lmlab.testing")


@pytest.mark.parametrize("check", testing.iter_checks(Mamba))
def test_mamba_conforms_at_its_defaults(check):
    check()


def test_mamba_conforms_with_short_chunks_and_other_shapes():
    # compile is checked once above; it is the slow check.
    testing.check_attention(Mamba, {"chunk_size": 3, "d_state": 4, "d_conv": 2, "expand": 1, "dt_rank": 2,
                                    "conv_bias": False}, skip=["compile"])
