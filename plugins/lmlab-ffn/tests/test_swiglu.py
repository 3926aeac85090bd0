"""Properties of the ``swiglu`` feed-forward plugin."""

import pytest
import torch
from torch import nn

from lmlab.api import ModelShape
from lmlab_ffn.swiglu import SwiGLUFeedForward, llama_hidden


def make_shape(**overrides) -> ModelShape:
    return ModelShape(**{"n_layers": 2, "d_model": 32, "n_heads": 4, "block_size": 16, "vocab_size": 11,
                         **overrides})


def build(shape: ModelShape, **options):
    return SwiGLUFeedForward(SwiGLUFeedForward.Options(**options)).build(shape, layer=0)


@pytest.mark.parametrize("bias", [False, True])
def test_swiglu_equals_hugging_face_llama_mlp(bias):
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    from transformers import LlamaConfig

    torch.manual_seed(0)
    ours = build(make_shape(bias=bias), hidden=48)
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_(0.0, 0.3)
    theirs = llama.LlamaMLP(LlamaConfig(hidden_size=32, intermediate_size=48, mlp_bias=bias, hidden_act="silu"))
    theirs.load_state_dict(ours.state_dict())  # same names: gate_proj, up_proj, down_proj
    x = torch.randn(2, 5, 32)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-6, atol=1e-6)


def test_default_hidden_width_follows_llama():
    assert llama_hidden(4096, 256) == 11008  # Llama-7B
    assert llama_hidden(128, 256) == 512
    ffn = build(make_shape(d_model=32), multiple_of=16)  # 2/3 of 128 is 85, rounded up to 96
    assert ffn.gate_proj.weight.shape == ffn.up_proj.weight.shape == (96, 32)


def test_explicit_hidden_width_and_output_shape():
    ffn = build(make_shape(), hidden=40)
    assert ffn.down_proj.weight.shape == (32, 40)
    assert ffn(torch.randn(3, 7, 32)).shape == (3, 7, 32)


def test_swiglu_has_no_dropout_of_its_own():
    ffn = build(make_shape(dropout=0.5), hidden=40).train()
    x = torch.randn(2, 5, 32)
    torch.testing.assert_close(ffn(x), ffn(x), rtol=0, atol=0)
    assert not any(isinstance(m, nn.Dropout) for m in ffn.modules())


def test_swiglu_init_scales_the_output_projection():
    shape = make_shape(n_layers=8, d_model=64, bias=True)
    ffn = build(shape, hidden=256)
    for weight, std in [(ffn.gate_proj.weight, shape.init_std), (ffn.up_proj.weight, shape.init_std),
                        (ffn.down_proj.weight, shape.residual_init_std)]:
        assert abs(weight.std().item() - std) < 0.1 * std
    assert not any(lin.bias.any() for lin in (ffn.gate_proj, ffn.up_proj, ffn.down_proj))
