"""Properties of the mha / gqa / mqa attention plugins, on tiny fp32 shapes."""

import math
from importlib.metadata import entry_points

import pytest
import torch
from torch import nn

from lmlab.api import MixerContext, ModelShape, PositionModule, UserError

ATTENTIONS = ["mha", "gqa", "mqa"]


def make_shape(**overrides) -> ModelShape:
    return ModelShape(**{"n_layers": 2, "d_model": 32, "n_heads": 4, "block_size": 16, "vocab_size": 11,
                         **overrides})


def plugin(slot: str, name: str, **options):
    matches = entry_points(group=f"lmlab.{slot}", name=name)
    if not matches:
        pytest.skip(f"no {slot} plugin {name!r} installed")
    cls = next(iter(matches)).load()
    return cls(cls.Options(**options))


def build_attention(name: str, shape: ModelShape, **options):
    torch.manual_seed(0)
    module = plugin("attention", name, **options).build(shape, layer=0)
    # Larger than the init std so softmax is far from uniform and a wrong score would show.
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.3)
    return module.eval()


class LinearBias(PositionModule):
    """ALiBi-like test double so the attention_bias path is exercised: head h adds -slope_h·|q - k|."""

    biases = True

    def __init__(self, n_heads: int):
        super().__init__()
        self.slopes = 2.0 ** -torch.arange(1, n_heads + 1, dtype=torch.float)

    def attention_bias(self, q_positions, k_positions):
        distance = (q_positions[:, None] - k_positions[None, :]).abs().float()  # (Tq, Tk)
        return -self.slopes[:, None, None] * distance                               # (H, Tq, Tk)


def make_position(name: str, shape: ModelShape) -> PositionModule:
    if name == "none":
        return PositionModule()
    if name == "linear-bias":
        return LinearBias(shape.n_heads)
    torch.manual_seed(1)
    return plugin("position", name).build(shape)


POSITIONS = ["none", "learned", "rope", "linear-bias"]


def forward(attn, position, x, start=0, state=None, causal=True):
    """The model's path through one layer: position embedding, then attention."""
    positions = torch.arange(start, start + x.shape[1])
    return attn(position.embed(x, positions), MixerContext(position, positions, start, causal=causal), state)


def reference_attention(x, attn, position=None, causal=True):
    """softmax(QK^T/sqrt(hs) + bias + causal mask) V written out, kv heads repeated per query group;
    without the mask when not ``causal``."""
    B, T, C = x.shape
    H, Hkv = attn.n_heads, attn.n_kv_heads
    hs = C // H
    wq, wk, wv = attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight
    q = (x @ wq.T).view(B, T, H, hs).transpose(1, 2)
    k = (x @ wk.T).view(B, T, Hkv, hs).transpose(1, 2)
    v = (x @ wv.T).view(B, T, Hkv, hs).transpose(1, 2)
    positions = torch.arange(T)
    if position is not None and position.rotates:
        q, k = position.rotate(q, k, positions)
    k, v = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(hs)                        # (B, H, T, T)
    if position is not None and position.biases:
        scores = scores + position.attention_bias(positions, positions)
    if causal:
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    y = (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(B, T, C)
    return y @ attn.out_proj.weight.T


def test_gqa_with_n_kv_heads_equal_to_n_heads_equals_reference_multi_head_attention():
    shape = make_shape()
    attn = build_attention("gqa", shape, n_kv_heads=4)
    x = torch.randn(2, 7, 32)
    y = attn(x, MixerContext(PositionModule(), torch.arange(7)))
    torch.testing.assert_close(y, reference_attention(x, attn), rtol=1e-5, atol=1e-5)


def test_gqa_with_n_kv_heads_equal_to_n_heads_equals_torch_multihead_attention():
    shape = make_shape(bias=True)
    attn = build_attention("gqa", shape, n_kv_heads=4)
    torch_mha = nn.MultiheadAttention(32, 4, bias=True, batch_first=True).eval()
    with torch.no_grad():  # torch packs q, k, v rows in that order
        torch_mha.in_proj_weight.copy_(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
        torch_mha.in_proj_bias.copy_(torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]))
        torch_mha.out_proj.weight.copy_(attn.out_proj.weight)
        torch_mha.out_proj.bias.copy_(attn.out_proj.bias)
    x = torch.randn(2, 7, 32)
    expected, _ = torch_mha(x, x, x, attn_mask=torch.ones(7, 7, dtype=torch.bool).triu(1), need_weights=False)
    torch.testing.assert_close(attn(x, MixerContext(PositionModule(), torch.arange(7))), expected,
                               rtol=1e-5, atol=1e-5)


def test_gqa_with_one_kv_head_equals_mqa():
    shape = make_shape()
    gqa, mqa = build_attention("gqa", shape, n_kv_heads=1), build_attention("mqa", shape)
    mqa.load_state_dict(gqa.state_dict())
    x = torch.randn(2, 7, 32)
    ctx = MixerContext(PositionModule(), torch.arange(7))
    torch.testing.assert_close(gqa(x, ctx), mqa(x, ctx), rtol=0, atol=0)


def test_gqa_with_two_kv_heads_equals_reference_with_kv_heads_repeated():
    attn = build_attention("gqa", make_shape(), n_kv_heads=2)
    assert attn.k_proj.weight.shape == attn.v_proj.weight.shape == (2 * 8, 32)  # half the keys and values of MHA
    x = torch.randn(2, 7, 32)
    y = attn(x, MixerContext(PositionModule(), torch.arange(7)))
    torch.testing.assert_close(y, reference_attention(x, attn), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("position_name", ["rope", "linear-bias"])
@pytest.mark.parametrize("name", ATTENTIONS)
def test_attention_applies_rotation_and_score_bias_of_the_position_module(name, position_name):
    shape = make_shape()
    attn, position = build_attention(name, shape), make_position(position_name, shape)
    x = torch.randn(2, 7, 32)
    torch.testing.assert_close(forward(attn, position, x), reference_attention(x, attn, position),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("position_name", POSITIONS)
@pytest.mark.parametrize("name", ATTENTIONS)
def test_changing_later_tokens_leaves_earlier_outputs_unchanged(name, position_name):
    shape = make_shape()
    attn, position = build_attention(name, shape), make_position(position_name, shape)
    x = torch.randn(2, 9, 32)
    for t in (0, 4, 7):
        changed = x.clone()
        changed[:, t + 1:] = torch.randn_like(changed[:, t + 1:])
        before, after = forward(attn, position, x), forward(attn, position, changed)
        torch.testing.assert_close(after[:, :t + 1], before[:, :t + 1], rtol=1e-6, atol=1e-6)
        assert not torch.allclose(after[:, t + 1:], before[:, t + 1:])


@pytest.mark.parametrize("position_name", ["none", "rope", "linear-bias", "alibi"])
@pytest.mark.parametrize("name", ATTENTIONS)
def test_bidirectional_attention_equals_the_unmasked_softmax_reference(name, position_name):
    shape = make_shape()
    attn, position = build_attention(name, shape), make_position(position_name, shape)
    x = torch.randn(2, 7, 32)
    expected = reference_attention(position.embed(x, torch.arange(7)), attn, position, causal=False)
    torch.testing.assert_close(forward(attn, position, x, causal=False), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("position_name", POSITIONS)
@pytest.mark.parametrize("name", ATTENTIONS)
def test_bidirectional_outputs_change_with_later_tokens(name, position_name):
    shape = make_shape()
    attn, position = build_attention(name, shape), make_position(position_name, shape)
    x = torch.randn(2, 9, 32)
    changed = x.clone()
    changed[:, 5:] = torch.randn_like(changed[:, 5:])
    before, after = forward(attn, position, x, causal=False), forward(attn, position, changed, causal=False)
    assert ((after[:, :5] - before[:, :5]).abs().amax(dim=(0, 2)) > 1e-3).all()  # every earlier position


@pytest.mark.parametrize("name", ATTENTIONS)
def test_attention_plugins_pass_the_bidirectional_conformance_check(name):
    from lmlab.testing import iter_checks

    cls = type(plugin("attention", name))
    assert cls.bidirectional is True
    (check,) = [c for c in iter_checks(cls, {"n_kv_heads": 2} if name == "gqa" else None) if c.name == "bidirectional"]
    check()


@pytest.mark.parametrize("chunks", [[4, 1, 1, 1, 1, 1, 1], [3, 4, 1, 1, 1], [1] * 10, [2, 5, 3]],
                         ids=["prefill-then-tokens", "chunk-after-prefill", "token-by-token", "chunks"])
@pytest.mark.parametrize("position_name", POSITIONS)
@pytest.mark.parametrize("name", ATTENTIONS)
def test_decoding_through_the_kv_cache_equals_the_full_forward(name, position_name, chunks):
    shape = make_shape()
    attn, position = build_attention(name, shape), make_position(position_name, shape)
    x = torch.randn(2, 10, 32)
    state = attn.new_state(2, 12, x.device, x.dtype)  # longer than needed: unused slots must not leak in
    outputs, start = [], 0
    for n in chunks:
        outputs.append(forward(attn, position, x[:, start:start + n], start=start, state=state))
        start += n
    torch.testing.assert_close(torch.cat(outputs, dim=1), forward(attn, position, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name, n_kv_heads", [("mha", 4), ("gqa", 2), ("mqa", 1)])
def test_kv_cache_holds_only_the_kv_heads(name, n_kv_heads):
    state = build_attention(name, make_shape(), **({"n_kv_heads": 2} if name == "gqa" else {})).new_state(
        3, 12, "cpu", torch.float32)
    assert state.k.shape == state.v.shape == (3, n_kv_heads, 12, 8)


def test_gqa_defaults_to_one_kv_head_per_query_head():
    assert build_attention("gqa", make_shape()).n_kv_heads == 4


@pytest.mark.parametrize("n_kv_heads", [3, 8])
def test_n_kv_heads_that_does_not_divide_n_heads_is_a_user_error(n_kv_heads):
    gqa = plugin("attention", "gqa", n_kv_heads=n_kv_heads)
    with pytest.raises(UserError) as error:
        gqa.build(make_shape(), layer=0)
    assert error.value.key == "attention.n_kv_heads"
    assert "attention.n_kv_heads" in str(error.value)


def test_dropout_applies_in_training_only():
    dropped, plain = build_attention("gqa", make_shape(dropout=0.5)), build_attention("gqa", make_shape())
    plain.load_state_dict(dropped.state_dict())
    x = torch.randn(2, 7, 32)
    ctx = MixerContext(PositionModule(), torch.arange(7))
    torch.testing.assert_close(dropped.eval()(x, ctx), plain(x, ctx), rtol=0, atol=0)
    assert not torch.allclose(dropped.train()(x, ctx), plain(x, ctx))


def test_reset_parameters_scales_the_output_projection_and_zeroes_biases():
    shape = make_shape(n_layers=8, d_model=64, bias=True)
    attn = plugin("attention", "mha").build(shape, layer=0)
    attn.reset_parameters(shape)
    for weight, std in [(attn.q_proj.weight, shape.init_std), (attn.k_proj.weight, shape.init_std),
                        (attn.v_proj.weight, shape.init_std), (attn.out_proj.weight, shape.residual_init_std)]:
        assert abs(weight.std().item() - std) < 0.1 * std
    assert all(not lin.bias.any() for lin in (attn.q_proj, attn.k_proj, attn.v_proj, attn.out_proj))


class RaggedKV:
    """The core's ragged cache in miniature: row ``rows[i]`` of a forward pass writes its keys and
    values at its own length ``starts[i]``, and every row gets back slots 0..S-1, S the longest row's
    length (slot s holds position s; what a shorter row has not written stays zero, for the mask to
    hide)."""

    def __init__(self, batch_size: int, layout: tuple[int, int], max_len: int):
        n_kv_heads, head_dim = layout
        self.k = torch.zeros(batch_size, n_kv_heads, max_len, head_dim)
        self.v = torch.zeros_like(self.k)
        self.rows, self.starts = [], []  # set before each forward pass

    def update(self, k, v, start):
        T = k.shape[2]  # start is ignored: the rows' lengths differ, and the store knows them
        for i, (row, begin) in enumerate(zip(self.rows, self.starts)):
            self.k[row, :, begin:begin + T], self.v[row, :, begin:begin + T] = k[i], v[i]
        S = max(self.starts) + T
        return self.k[self.rows, :, :S], self.v[self.rows, :, :S]


def ragged_forward(attn, position, store, x, rows, starts):
    """The core's ragged step through one layer: x[i] continues row rows[i], which holds starts[i]
    tokens, at per-row positions, under a key mask of each query's own row up to itself."""
    store.rows, store.starts = rows, starts
    positions = torch.tensor(starts)[:, None] + torch.arange(x.shape[1])          # (B, T)
    key_mask = torch.arange(max(starts) + x.shape[1]) <= positions[:, :, None]    # (B, T, S)
    ctx = MixerContext(position, positions, start=0, key_mask=key_mask[:, None])   # (B, 1, T, S)
    return attn(position.embed(x, positions), ctx, store)


@pytest.mark.parametrize("position_name", ["none", "learned", "rope", "alibi"])
@pytest.mark.parametrize("name", ATTENTIONS)
def test_ragged_decoding_equals_decoding_each_row_alone(name, position_name):
    shape = make_shape()
    attn = build_attention(name, shape, **({"n_kv_heads": 2} if name == "gqa" else {}))
    position = make_position(position_name, shape)
    assert attn.kv_layout() == (attn.n_kv_heads, 8)
    # Prompts of different lengths, then steps for all rows together (one of two tokens); the
    # shortest row attends past the end of its keys unless the mask stops it.
    lengths, steps = [5, 2, 7], [1, 1, 2, 1]
    torch.manual_seed(2)
    xs = [torch.randn(1, n + sum(steps), 32) for n in lengths]

    expected = []  # each row alone through the plain KV cache
    for x, n in zip(xs, lengths):
        state, outputs, start = attn.new_state(1, x.shape[1], x.device, x.dtype), [], 0
        for chunk in [n, *steps]:
            outputs.append(forward(attn, position, x[:, start:start + chunk], start=start, state=state))
            start += chunk
        expected.append(torch.cat(outputs, dim=1))

    store = RaggedKV(len(xs), attn.kv_layout(), max(lengths) + sum(steps))
    got = [[ragged_forward(attn, position, store, x[:, :n], [row], [0])]  # prefill one row at a time
           for row, (x, n) in enumerate(zip(xs, lengths))]
    starts = list(lengths)
    for chunk in steps:
        y = ragged_forward(attn, position, store, torch.cat([x[:, s:s + chunk] for x, s in zip(xs, starts)]),
                           [0, 1, 2], starts)
        for row in range(3):
            got[row].append(y[row:row + 1])
        starts = [s + chunk for s in starts]
    for row in range(3):
        torch.testing.assert_close(torch.cat(got[row], dim=1), expected[row], rtol=1e-5, atol=1e-5)
