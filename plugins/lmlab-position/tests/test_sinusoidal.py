"""Properties of the ``sinusoidal`` position plugin."""

import math

import pytest
import torch

from lmlab.api import ModelShape
from lmlab_position.sinusoidal import SinusoidalPosition


def make_sinusoidal(d_model: int = 16, base: float = 10000.0, block_size: int = 8):
    shape = ModelShape(n_layers=1, d_model=d_model, n_heads=4, block_size=block_size, vocab_size=11)
    return SinusoidalPosition(SinusoidalPosition.Options(base=base)).build(shape)


def encoding(module, positions: torch.Tensor, d_model: int) -> torch.Tensor:
    x = torch.zeros(1, len(positions), d_model)
    return module.embed(x, positions)[0]


class AnnotatedTransformerPositionalEncoding(torch.nn.Module):
    """The table of "The Annotated Transformer" (Rush et al., harvardnlp), dropout left out."""

    def __init__(self, d_model, max_len=5000):
        super().__init__()
        pe = torch.zeros(max_len, d_model)
        position = torch.arange(0, max_len).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2) * -(math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        pe = pe.unsqueeze(0)
        self.register_buffer("pe", pe)

    def forward(self, x):
        return x + self.pe[:, : x.size(1)].requires_grad_(False)


@pytest.mark.parametrize("base", [10000.0, 100.0])
def test_sinusoidal_matches_the_formula_written_out(base):
    d, positions = 10, [0, 1, 2, 7, 8, 31, 500]
    got = encoding(make_sinusoidal(d, base), torch.tensor(positions), d)
    expected = torch.zeros(len(positions), d, dtype=torch.float64)
    for row, pos in enumerate(positions):
        for i in range(d // 2):
            expected[row, 2 * i] = math.sin(pos / base ** (2 * i / d))
            expected[row, 2 * i + 1] = math.cos(pos / base ** (2 * i / d))
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-5)


def test_sinusoidal_equals_the_annotated_transformer_table():
    d = 32
    reference = AnnotatedTransformerPositionalEncoding(d, max_len=2000)
    x = torch.randn(3, 300, d)
    torch.testing.assert_close(make_sinusoidal(d).embed(x, torch.arange(300)), reference(x), rtol=0, atol=1e-4)
    scattered = torch.tensor([5, 64, 65, 1999])  # beyond block_size = 8: computed, not looked up
    torch.testing.assert_close(encoding(make_sinusoidal(d), scattered, d), reference.pe[0, scattered],
                               rtol=0, atol=1e-4)


def test_sinusoidal_adds_the_same_encoding_to_every_sequence_of_the_batch():
    module, x = make_sinusoidal(), torch.randn(4, 6, 16)
    added = module.embed(x, torch.arange(6)) - x
    torch.testing.assert_close(added, added[:1].expand(4, 6, 16))
    assert module.adds_embedding and not module.rotates and not module.biases


def test_sinusoidal_offset_is_a_fixed_rotation_of_each_frequency_pair():
    # The paper's motivation: PE[pos + k] is a linear function of PE[pos] that depends on k only.
    d, k, base = 16, 5, 10000.0
    module, positions = make_sinusoidal(d, base), torch.arange(0, 200, 7)
    pe, shifted = encoding(module, positions, d).double(), encoding(module, positions + k, d).double()
    rotation = torch.zeros(d, d, dtype=torch.float64)
    for i in range(d // 2):
        a = k / base ** (2 * i / d)  # (sin, cos)(p + a) = (sin p, cos p) @ [[cos a, -sin a], [sin a, cos a]]
        rotation[2 * i: 2 * i + 2, 2 * i: 2 * i + 2] = torch.tensor([[math.cos(a), -math.sin(a)],
                                                                      [math.sin(a), math.cos(a)]], dtype=torch.float64)
    torch.testing.assert_close(pe @ rotation, shifted, rtol=0, atol=1e-4)


def test_sinusoidal_has_no_parameters_and_no_longest_position():
    module = make_sinusoidal(block_size=8)
    assert module.max_positions is None
    assert list(module.parameters()) == [] and module.state_dict() == {}


def test_sinusoidal_odd_width_keeps_sin_in_the_last_dimension():
    got = encoding(make_sinusoidal(7), torch.tensor([3]), 7)
    assert got.shape == (1, 7)
    assert abs(got[0, 6].item() - math.sin(3 / 10000 ** (6 / 7))) < 1e-6


def test_sinusoidal_keeps_the_input_dtype():
    x = torch.randn(1, 4, 16, dtype=torch.bfloat16)
    assert make_sinusoidal().embed(x, torch.arange(4)).dtype == torch.bfloat16


@pytest.mark.parametrize("d_model", [16, 7])
def test_sinusoidal_adds_each_rows_own_positions(d_model):
    module = make_sinusoidal(d_model)
    assert module.per_row
    x, positions = torch.randn(3, 4, d_model), torch.tensor([[0, 1, 2, 3], [5, 6, 7, 8], [90, 91, 500, 2]])  # (B, T)
    got = module.embed(x, positions)
    assert got.shape == (3, 4, d_model)
    for b in range(3):  # exactly what the row gets alone, with (T,) positions
        assert torch.equal(got[b:b + 1], module.embed(x[b:b + 1], positions[b]))
    assert not torch.allclose(got - x, module.embed(x, positions[0]) - x)  # the rows' positions differ
