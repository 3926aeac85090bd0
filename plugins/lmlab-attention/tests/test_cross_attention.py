"""Cross-attention (API 1.13): mha, gqa and mqa pass the kit's cross_attention check; a module that
ignores the encoder's padding, or masks the encoder causally, fails it."""

import pytest
import torch

from lmlab.testing import ConformanceError, iter_checks
from lmlab_attention.gqa import CrossAttention, GroupedQueryAttention, MultiHeadAttention, MultiQueryAttention


def cross_check(cls, options=None):
    (check,) = [c for c in iter_checks(cls, options) if c.name == "cross_attention"]
    return check


@pytest.mark.parametrize("cls, options", [(MultiHeadAttention, None), (GroupedQueryAttention, {"n_kv_heads": 2}),
                                          (MultiQueryAttention, None)], ids=["mha", "gqa", "mqa"])
def test_first_party_cross_attention_passes_the_kit(cls, options):
    cross_check(cls, options)()


class IgnoresPadding(CrossAttention):
    def forward(self, x, ctx, state=None):
        ctx.memory_padding = None
        return super().forward(x, ctx, state)


class CausalOverMemory(CrossAttention):
    def forward(self, x, ctx, state=None):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k, v = self.memory_kv(ctx.memory) if state is None else state
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.out_proj(y.transpose(1, 2).reshape(B, T, -1))


def broken(module_type):
    class Broken(MultiHeadAttention):
        name = f"broken-{module_type.__name__.lower()}"

        def build_cross(self, shape, layer):
            return module_type(shape, shape.n_heads)
    return Broken


@pytest.mark.parametrize("module_type, says", [(IgnoresPadding, "padded memory positions"),
                                               (CausalOverMemory, "every query must see every")])
def test_broken_cross_attention_fails_the_kit(module_type, says):
    with pytest.raises(ConformanceError, match=says):
        cross_check(broken(module_type))()
