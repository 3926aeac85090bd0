"""Mamba is a left-to-right recurrence: it declares no bidirectional support and refuses to run as if
it had one."""

import pytest
import torch

from lmlab.api import MixerContext, ModelShape, PositionModule, UserError
from lmlab_mamba.mamba import Mamba

SHAPE = ModelShape(n_layers=1, d_model=32, n_heads=4, block_size=16, vocab_size=11)


def test_mamba_declares_causal_only():
    assert Mamba.bidirectional is False


def test_a_bidirectional_context_is_refused_naming_attention_use():
    mixer = Mamba().build(SHAPE, layer=0)
    ctx = MixerContext(PositionModule(), torch.arange(4), causal=False)
    with pytest.raises(UserError) as info:
        mixer(torch.randn(1, 4, 32), ctx)
    assert info.value.key == "attention.use"
