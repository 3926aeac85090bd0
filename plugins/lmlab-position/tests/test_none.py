"""Properties of the ``none`` position plugin."""

import importlib.metadata as md

import torch

from lmlab.api import MixerContext, ModelShape
from lmlab_position.none import NoPosition

SHAPE = ModelShape(n_layers=1, d_model=32, n_heads=4, block_size=16, vocab_size=11)


def test_none_changes_nothing_anywhere():
    module = NoPosition().build(SHAPE)
    x, q, k, positions = torch.randn(2, 5, 32), torch.randn(2, 4, 5, 8), torch.randn(2, 1, 5, 8), torch.arange(5)
    assert module.embed(x, positions) is x
    rq, rk = module.rotate(q, k, positions)
    assert rq is q and rk is k
    assert module.attention_bias(positions, positions) is None
    assert not (module.adds_embedding or module.rotates or module.biases)


def test_none_has_no_parameters_and_no_longest_position():
    module = NoPosition().build(SHAPE)
    assert module.max_positions is None
    assert list(module.parameters()) == [] and module.state_dict() == {}


def test_causal_attention_without_positions_sees_its_prefix_as_a_set():
    # With no position information the last token's output cannot depend on the order of the tokens
    # before it; with any position scheme it would.
    (entry,) = md.entry_points(group="lmlab.attention", name="mha")
    torch.manual_seed(0)
    attn = entry.load()().build(SHAPE, layer=0).eval()
    ctx = MixerContext(position=NoPosition().build(SHAPE), positions=torch.arange(6))
    x = torch.randn(1, 6, 32)
    shuffled = x[:, [3, 0, 4, 2, 1, 5]]
    torch.testing.assert_close(attn(x, ctx)[:, -1], attn(shuffled, ctx)[:, -1], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(attn(x, ctx)[:, 1], attn(shuffled, ctx)[:, 1], atol=1e-4)


def test_none_takes_per_row_positions_and_still_changes_nothing():
    module = NoPosition().build(SHAPE)
    assert module.per_row
    x, q, k = torch.randn(2, 3, 32), torch.randn(2, 4, 3, 8), torch.randn(2, 1, 3, 8)
    positions = torch.tensor([[0, 1, 2], [5, 6, 7]])  # (B, T)
    assert module.embed(x, positions) is x
    rq, rk = module.rotate(q, k, positions)
    assert rq is q and rk is k
    assert module.attention_bias(positions, torch.arange(8)) is None
