"""ffn `none`: the block keeps its mixer and loses its feed-forward part entirely."""

import torch

from lmlab.api import FFNModule, ModelShape
from lmlab_ffn.none import NoFFN

SHAPE = ModelShape(n_layers=2, d_model=16, n_heads=2, block_size=8, vocab_size=11)


def test_none_builds_a_module_the_block_skips_and_that_has_no_parameters():
    module = NoFFN().build(SHAPE, layer=0)
    assert isinstance(module, FFNModule) and module.skip
    assert list(module.parameters()) == []
    assert not module(torch.randn(2, 3, 16)).any()
