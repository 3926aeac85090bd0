"""Properties of the ``t5`` position plugin: buckets and biases equal Hugging Face's T5, per-row queries,
the options' limits, and lmlab's conformance kit."""

import dataclasses

import pytest
import torch

from lmlab.api import ModelShape, UserError
from lmlab.testing import iter_checks
from lmlab_position.t5_bias import T5RelativePosition, relative_position_bucket

SETTINGS = [(32, 128), (16, 64)]  # (num_buckets, max_distance): T5's, and a smaller table


def make_shape(n_heads: int = 4, causal: bool = True) -> ModelShape:
    return ModelShape(n_layers=1, d_model=8 * n_heads, n_heads=n_heads, block_size=16, vocab_size=11, causal=causal)


def make_t5(causal: bool = True, num_buckets: int = 32, max_distance: int = 128, n_heads: int = 4, seed: int = 0):
    plugin = T5RelativePosition(T5RelativePosition.Options(num_buckets=num_buckets, max_distance=max_distance))
    shape = make_shape(n_heads=n_heads, causal=causal)
    module = plugin.build(shape)
    torch.manual_seed(seed)
    module.reset_parameters(shape)
    return module


def hf_t5_attention(bidirectional: bool, num_buckets: int, max_distance: int, n_heads: int = 4):
    """Hugging Face's T5Attention holding the relative bias table, for the encoder or the decoder."""
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
    from transformers import T5Config

    config = T5Config(vocab_size=11, d_model=8 * n_heads, d_kv=8, d_ff=16, num_layers=1, num_heads=n_heads,
                      relative_attention_num_buckets=num_buckets, relative_attention_max_distance=max_distance,
                      is_decoder=not bidirectional, dropout_rate=0.0)
    return t5.T5Attention(config, has_relative_attention_bias=True, layer_idx=0).eval()


@pytest.mark.parametrize("num_buckets,max_distance", SETTINGS)
@pytest.mark.parametrize("bidirectional", [True, False], ids=["bidirectional", "causal"])
def test_buckets_equal_hugging_face_for_every_relative_position(bidirectional, num_buckets, max_distance):
    hf = pytest.importorskip("transformers.models.t5.modeling_t5").T5Attention
    relative = torch.arange(-300, 301)
    ours = relative_position_bucket(relative, bidirectional, num_buckets, max_distance)
    theirs = hf._relative_position_bucket(relative, bidirectional=bidirectional, num_buckets=num_buckets,
                                          max_distance=max_distance)
    assert ours.dtype == torch.int64
    assert torch.equal(ours, theirs.long())
    # Every row of the table is reached, except, bidirectionally, the first of the upper half (as in T5:
    # distance 0 falls in the lower half, so "0 after the query" never occurs).
    expected = [b for b in range(num_buckets) if not (bidirectional and b == num_buckets // 2)]
    assert sorted(set(ours.tolist())) == expected


def test_bucket_layout_is_t5s():
    # Causal: distance d back from the query has bucket d for d < 16, then log bins; keys after share 0.
    causal = relative_position_bucket(torch.tensor([0, -1, -15, -16, -127, -128, -1000, 1, 50]), False, 32, 128)
    assert causal.tolist() == [0, 1, 15, 16, 31, 31, 31, 0, 0]
    # Bidirectional: keys before the query in 0..15, keys after it in 16..31.
    both = relative_position_bucket(torch.tensor([0, -1, -7, 1, 7, -1000, 1000]), True, 32, 128)
    assert both.tolist() == [0, 1, 7, 17, 23, 15, 31]


@pytest.mark.parametrize("num_buckets,max_distance", SETTINGS)
@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder"])
def test_attention_bias_equals_hugging_face_compute_bias(causal, num_buckets, max_distance):
    ours = make_t5(causal=causal, num_buckets=num_buckets, max_distance=max_distance)
    assert ours.bidirectional is (not causal)
    hf = hf_t5_attention(bidirectional=not causal, num_buckets=num_buckets, max_distance=max_distance)
    assert hf.relative_attention_bias.weight.shape == ours.relative_attention_bias.weight.shape
    # The parameter has T5's name, so T5's state dict entry loads as it is.
    ours.load_state_dict({"relative_attention_bias.weight": hf.relative_attention_bias.weight.detach().clone()})
    T = 150  # past max_distance in the (16, 64) setting, and near it in T5's
    with torch.no_grad():
        expected = hf.compute_bias(T, T)[0]                                   # (H, T, T)
        got = ours.attention_bias(torch.arange(T), torch.arange(T))
        assert got.shape == (4, T, T)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        # Decoding: one query at position 7 over the keys 0..7 (HF: past_seen_tokens = 7).
        step = ours.attention_bias(torch.tensor([7]), torch.arange(8))
        torch.testing.assert_close(step, hf.compute_bias(1, 8, past_seen_tokens=7)[0], rtol=0, atol=0)
        torch.testing.assert_close(step, got[:, 7:8, :8], rtol=0, atol=0)
        # A chunk of queries 40..45 over the keys 0..45.
        chunk = ours.attention_bias(torch.arange(40, 46), torch.arange(46))
        torch.testing.assert_close(chunk, hf.compute_bias(6, 46, past_seen_tokens=40)[0], rtol=0, atol=0)


def test_encoder_and_decoder_buckets_differ():
    encoder, decoder = make_t5(causal=False), make_t5(causal=True)
    q, k = torch.arange(8), torch.arange(8)
    # Both give keys up to 7 back from the query an exact bucket each (the encoder has 8 per side, the
    # decoder 16); only the encoder tells keys after the query apart.
    assert torch.equal(encoder.buckets(q, k).tril(), decoder.buckets(q, k).tril())
    after = k[None, :] > q[:, None]
    assert (decoder.buckets(q, k)[after] == 0).all() and (encoder.buckets(q, k)[after] >= 16).all()
    # Farther back the encoder's buckets grow logarithmically sooner: 9 back is bucket 8 there, 9 here.
    assert encoder.buckets(torch.tensor([9]), torch.tensor([0])).item() == 8
    assert decoder.buckets(torch.tensor([9]), torch.tensor([0])).item() == 9


def test_bias_is_the_table_row_of_each_bucket_and_depends_only_on_distance():
    t5 = make_t5(causal=False)
    q, k = torch.tensor([3, 4, 9]), torch.arange(12)
    bias = t5.attention_bias(q, k)
    table = t5.relative_attention_bias.weight
    for i, qi in enumerate(q.tolist()):
        for j, kj in enumerate(k.tolist()):
            bucket = relative_position_bucket(torch.tensor(kj - qi), True, 32, 128)
            assert torch.equal(bias[:, i, j], table[bucket])
    torch.testing.assert_close(t5.attention_bias(torch.arange(8), torch.arange(8)),
                               t5.attention_bias(torch.arange(1000, 1008), torch.arange(1000, 1008)), rtol=0, atol=0)


@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder"])
def test_per_row_queries_stack_each_rows_own_bias(causal):
    t5 = make_t5(causal=causal)
    assert t5.per_row
    q_pos, k_pos = torch.tensor([[3, 4, 5], [9, 10, 11], [0, 1, 2]]), torch.arange(12)  # (B, Tq), keys (Tk,)
    bias = t5.attention_bias(q_pos, k_pos)
    assert bias.shape == (3, 4, 3, 12)
    expected = torch.stack([t5.attention_bias(row, k_pos) for row in q_pos])
    assert torch.equal(bias, expected)
    assert not torch.equal(bias[0], bias[1])


def test_flags_parameters_and_init():
    t5 = make_t5(n_heads=4)
    assert t5.biases and not t5.rotates and not t5.adds_embedding and t5.per_row
    assert t5.max_positions is None
    assert list(t5.state_dict()) == ["relative_attention_bias.weight"]
    assert t5.relative_attention_bias.weight.shape == (32, 4)
    x = torch.randn(1, 3, 32)
    assert t5.embed(x, torch.arange(3)) is x
    shape = dataclasses.replace(make_shape(), init_std=0.5)
    big = T5RelativePosition().build(shape)
    big.reset_parameters(shape)
    assert 0.35 < big.relative_attention_bias.weight.std().item() < 0.65


def test_gradients_reach_only_the_rows_of_buckets_used():
    t5 = make_t5(causal=True)
    t5.attention_bias(torch.arange(4), torch.arange(4)).sum().backward()
    grad = t5.relative_attention_bias.weight.grad
    assert (grad[:4] != 0).all() and (grad[4:] == 0).all()  # causal distances 0..3 only


def test_options_refuse_a_max_distance_within_the_exact_buckets():
    with pytest.raises(UserError, match="max_distance"):
        T5RelativePosition(T5RelativePosition.Options(num_buckets=32, max_distance=16)).build(make_shape())
    # Bidirectional: 8 exact buckets per side, so 16 is allowed there.
    T5RelativePosition(T5RelativePosition.Options(num_buckets=32, max_distance=16)).build(make_shape(causal=False))
    with pytest.raises(ValueError):
        T5RelativePosition.Options(num_buckets=2)


# The default (causal) shape runs in test_conformance.py with the other plugins; here the encoder's
# bidirectional buckets, in the kit's (causal) reference model.
ENCODER_CHECKS = iter_checks(T5RelativePosition, shape=dataclasses.replace(make_shape(), causal=False, n_layers=2))


@pytest.mark.parametrize("check", ENCODER_CHECKS, ids=[f"encoder-{c.name}" for c in ENCODER_CHECKS])
def test_conformance_of_the_bidirectional_table(check):
    check()
