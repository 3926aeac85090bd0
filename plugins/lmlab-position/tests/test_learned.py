"""Properties of the ``learned`` position plugin."""

import pytest
import torch

from lmlab.api import ModelShape
from lmlab_position.learned import LearnedPosition

SHAPE = ModelShape(n_layers=1, d_model=32, n_heads=4, block_size=16, vocab_size=11)


def test_learned_embed_adds_the_row_of_each_position():
    torch.manual_seed(0)
    learned = LearnedPosition().build(SHAPE)
    x, positions = torch.randn(2, 5, 32), torch.tensor([3, 4, 5, 6, 15])
    torch.testing.assert_close(learned.embed(x, positions) - x, learned.wpe.weight[positions].expand(2, 5, 32))
    assert learned.adds_embedding and not learned.rotates and not learned.biases


def test_learned_covers_exactly_the_block_size():
    learned = LearnedPosition().build(SHAPE)
    assert learned.max_positions == 16
    learned.embed(torch.zeros(1, 2, 32), torch.tensor([14, 15]))
    with pytest.raises(IndexError):  # the model refuses such positions before it gets here
        learned.embed(torch.zeros(1, 2, 32), torch.tensor([15, 16]))


def test_learned_table_is_initialised_with_init_std_and_saved():
    shape = ModelShape(n_layers=1, d_model=64, n_heads=4, block_size=64, vocab_size=11, init_std=0.05)
    learned = LearnedPosition().build(shape)
    assert abs(learned.wpe.weight.std().item() - 0.05) < 0.005
    assert set(learned.state_dict()) == {"wpe.weight"}


def test_learned_embed_adds_each_rows_own_positions():
    torch.manual_seed(0)
    learned = LearnedPosition().build(SHAPE)
    assert learned.per_row
    x, positions = torch.randn(3, 4, 32), torch.tensor([[0, 1, 2, 3], [5, 6, 7, 8], [12, 13, 14, 15]])  # (B, T)
    got = learned.embed(x, positions)
    for b in range(3):  # exactly what the row gets alone, with (T,) positions
        assert torch.equal(got[b:b + 1], learned.embed(x[b:b + 1], positions[b]))
    assert not torch.allclose(got - x, learned.embed(x, positions[0]) - x)  # the rows' positions differ
