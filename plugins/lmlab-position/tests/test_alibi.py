"""Properties of the ``alibi`` position plugin, alone and inside the ``mha`` attention plugin."""

import importlib.metadata as md
import math

import pytest
import torch

from lmlab.api import MixerContext, ModelShape, PositionModule
from lmlab_position.alibi import ALiBiPosition


def make_shape(n_heads: int = 4, d_model: int = 32) -> ModelShape:
    return ModelShape(n_layers=1, d_model=d_model, n_heads=n_heads, block_size=16, vocab_size=11)


def make_alibi(n_heads: int = 4):
    return ALiBiPosition().build(make_shape(n_heads=n_heads, d_model=8 * n_heads))


def attention_plugin(name: str, shape: ModelShape):
    """Another installed plugin, found the way the core finds it: through its entry point."""
    (entry,) = md.entry_points(group="lmlab.attention", name=name)
    cls = entry.load()
    return cls(cls.Options()).build(shape, layer=0)


def test_alibi_slopes_for_8_heads_are_the_papers():
    assert make_alibi(8).slopes.tolist() == [1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 32, 1 / 64, 1 / 128, 1 / 256]


def test_alibi_slopes_for_4_and_16_heads_start_at_two_to_the_minus_8_over_n():
    assert make_alibi(4).slopes.tolist() == [2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8]
    torch.testing.assert_close(make_alibi(16).slopes, torch.tensor([2 ** (-0.5 * (i + 1)) for i in range(16)]))


def test_alibi_slopes_for_12_heads_follow_the_reference_code():
    # get_slopes(12) of ofirpress/attention_with_linear_biases: the 8-head slopes, then slopes
    # 0, 2, 4, 6 of the 16-head sequence 2^-0.5, 2^-1, 2^-1.5, ...
    expected = [2 ** -1, 2 ** -2, 2 ** -3, 2 ** -4, 2 ** -5, 2 ** -6, 2 ** -7, 2 ** -8,
                2 ** -0.5, 2 ** -1.5, 2 ** -2.5, 2 ** -3.5]
    torch.testing.assert_close(make_alibi(12).slopes, torch.tensor(expected))


def test_alibi_bias_is_minus_slope_times_distance():  # on both sides of the query
    alibi = make_alibi(4)
    q_pos, k_pos = torch.tensor([3, 4, 9]), torch.arange(10)
    bias = alibi.attention_bias(q_pos, k_pos)
    assert bias.shape == (4, 3, 10) and bias.dtype == torch.float32
    slopes = [2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8]
    for h in range(4):
        for i, q in enumerate(q_pos.tolist()):
            for j, k in enumerate(k_pos.tolist()):
                assert bias[h, i, j].item() == pytest.approx(-slopes[h] * abs(q - k))
    assert (bias[:, 2, :] <= 0).all() and (bias[:, :, 0] < 0).all()


def test_alibi_bias_is_symmetric_so_bidirectional_attention_penalises_both_sides_alike():
    bias = make_alibi(4).attention_bias(torch.arange(6), torch.arange(6))  # (H, T, T)
    torch.testing.assert_close(bias, bias.transpose(1, 2), rtol=0, atol=0)
    assert (bias[:, 1, 4] == bias[:, 1, 0] * 3).all()  # three to the right costs three times one to the left


def test_alibi_bias_depends_only_on_distance():
    alibi = make_alibi(4)
    torch.testing.assert_close(alibi.attention_bias(torch.arange(8), torch.arange(8)),
                               alibi.attention_bias(torch.arange(1000, 1008), torch.arange(1000, 1008)))


def test_alibi_has_no_parameters_and_no_longest_position():
    alibi = make_alibi(4)
    assert alibi.biases and not alibi.rotates and not alibi.adds_embedding
    assert alibi.max_positions is None
    assert list(alibi.parameters()) == [] and alibi.state_dict() == {}
    x = torch.randn(1, 3, 32)
    assert alibi.embed(x, torch.arange(3)) is x


def test_mha_with_alibi_equals_explicit_softmax_reference():
    torch.manual_seed(0)
    shape = make_shape(n_heads=4, d_model=32)
    alibi, attn = ALiBiPosition().build(shape), attention_plugin("mha", shape).eval()
    B, T, H, hs = 2, 7, 4, 8
    x, positions = torch.randn(B, T, 32), torch.arange(T)
    got = attn(x, MixerContext(position=alibi, positions=positions))

    q, k, v = (t.view(B, T, H, hs).transpose(1, 2) for t in (attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)))
    slopes = torch.tensor([2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8])
    distance = (positions[:, None] - positions[None, :]).float()
    scores = q @ k.transpose(-2, -1) / math.sqrt(hs) - slopes[:, None, None] * distance
    scores = scores.masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf"))
    expected = attn.out_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, 32))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    without = attn(x, MixerContext(position=PositionModule(), positions=positions))
    assert not torch.allclose(got, without, atol=1e-3)  # the bias did change the output


def test_kv_cache_decoding_with_alibi_equals_the_full_forward():
    torch.manual_seed(0)
    shape = make_shape(n_heads=4, d_model=32)
    alibi, attn = ALiBiPosition().build(shape), attention_plugin("mha", shape).eval()
    B, T, prefill = 2, 9, 4
    x = torch.randn(B, T, 32)
    full = attn(x, MixerContext(position=alibi, positions=torch.arange(T)))
    cache = attn.new_state(B, T, x.device, x.dtype)
    steps = [attn(x[:, :prefill], MixerContext(position=alibi, positions=torch.arange(prefill)), cache)]
    for t in range(prefill, T):
        steps.append(attn(x[:, t:t + 1], MixerContext(position=alibi, positions=torch.tensor([t]), start=t), cache))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


def test_bidirectional_mha_with_alibi_equals_the_unmasked_reference_with_symmetric_bias():
    torch.manual_seed(0)
    shape = make_shape(n_heads=4, d_model=32)
    alibi, attn = ALiBiPosition().build(shape), attention_plugin("mha", shape).eval()
    B, T, H, hs = 2, 7, 4, 8
    x, positions = torch.randn(B, T, 32), torch.arange(T)
    got = attn(x, MixerContext(position=alibi, positions=positions, causal=False))

    q, k, v = (t.view(B, T, H, hs).transpose(1, 2) for t in (attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)))
    slopes = torch.tensor([2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8])
    distance = (positions[:, None] - positions[None, :]).abs().float()
    scores = q @ k.transpose(-2, -1) / math.sqrt(hs) - slopes[:, None, None] * distance  # no mask
    expected = attn.out_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, 32))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # causal attention with the symmetric bias is unchanged: keys after the query are masked anyway
    causal = attn(x, MixerContext(position=alibi, positions=positions))
    assert not torch.allclose(got[:, :-1], causal[:, :-1], atol=1e-4)
    torch.testing.assert_close(got[:, -1], causal[:, -1], rtol=1e-5, atol=1e-5)  # the last token saw all in both


def test_alibi_bias_of_per_row_queries_is_each_rows_own():
    alibi = make_alibi(4)
    assert alibi.per_row
    q_pos, k_pos = torch.tensor([[3, 4, 5], [9, 10, 11], [0, 1, 2]]), torch.arange(12)  # (B, Tq), keys (Tk,)
    bias = alibi.attention_bias(q_pos, k_pos)
    assert bias.shape == (3, 4, 3, 12) and bias.dtype == torch.float32
    for b in range(3):  # exactly what the row gets alone, with (Tq,) positions
        assert torch.equal(bias[b], alibi.attention_bias(q_pos[b], k_pos))
    assert not torch.equal(bias[0], bias[1])
