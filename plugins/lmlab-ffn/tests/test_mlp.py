"""Properties of the ``mlp`` feed-forward plugin."""

import math

import pytest
import torch
from torch import nn

from lmlab.api import ModelShape
from lmlab_ffn.mlp import MLPFeedForward

ACTIVATIONS = {  # written out from their definitions, not through torch's modules
    "gelu": lambda h: 0.5 * h * (1 + torch.erf(h / math.sqrt(2))),
    "gelu-tanh": lambda h: 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3))),
    "relu": lambda h: h.clamp(min=0),
}


def make_shape(**overrides) -> ModelShape:
    return ModelShape(**{"n_layers": 2, "d_model": 32, "n_heads": 4, "block_size": 16, "vocab_size": 11,
                         **overrides})


def build(shape: ModelShape, **options):
    return MLPFeedForward(MLPFeedForward.Options(**options)).build(shape, layer=0)


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_mlp_equals_explicit_reference(activation):
    torch.manual_seed(0)
    mlp = build(make_shape(bias=True), activation=activation)
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0.0, 0.3)
    x = torch.randn(2, 5, 32)
    hidden = x @ mlp.c_fc.weight.T + mlp.c_fc.bias
    expected = ACTIVATIONS[activation](hidden) @ mlp.c_proj.weight.T + mlp.c_proj.bias
    torch.testing.assert_close(mlp(x), expected, rtol=1e-5, atol=1e-5)


def test_mlp_default_is_exact_gelu_at_four_times_width():
    mlp = build(make_shape())
    assert mlp.c_fc.weight.shape == (128, 32) and mlp.c_proj.weight.shape == (32, 128)
    assert mlp.c_fc.bias is None  # shape.bias is False
    h = torch.linspace(-3, 3, 13)
    torch.testing.assert_close(mlp.act(h), ACTIVATIONS["gelu"](h))


def test_explicit_hidden_width_and_output_shape():
    mlp = build(make_shape(), hidden=40)
    assert mlp.c_fc.weight.shape == (40, 32)
    assert mlp(torch.randn(3, 7, 32)).shape == (3, 7, 32)


def test_unknown_activation_is_refused_by_the_options():
    with pytest.raises(ValueError, match="activation"):
        MLPFeedForward.Options(activation="swish")


def test_mlp_has_no_dropout_of_its_own():
    mlp = build(make_shape(dropout=0.5)).train()
    x = torch.randn(2, 5, 32)
    torch.testing.assert_close(mlp(x), mlp(x), rtol=0, atol=0)
    assert not any(isinstance(m, nn.Dropout) for m in mlp.modules())


def test_mlp_init_scales_the_output_projection():
    shape = make_shape(n_layers=8, d_model=64, bias=True)
    mlp = build(shape)
    assert abs(mlp.c_fc.weight.std().item() - shape.init_std) < 0.1 * shape.init_std
    assert abs(mlp.c_proj.weight.std().item() - shape.residual_init_std) < 0.1 * shape.residual_init_std
    assert not mlp.c_fc.bias.any() and not mlp.c_proj.bias.any()
