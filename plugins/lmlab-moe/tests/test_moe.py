"""Properties of the ``moe`` feed-forward plugin, checked against a naive per-token reference."""

import importlib.metadata as md
import math

import pytest
import torch

from lmlab.api import ModelShape, UserError
from lmlab_moe.moe import MixtureOfExpertsFeedForward

D = 16


def make_shape(**overrides) -> ModelShape:
    return ModelShape(**{"n_layers": 2, "d_model": D, "n_heads": 4, "block_size": 16, "vocab_size": 11, **overrides})


def build(shape: ModelShape | None = None, seed: int = 0, **options):
    torch.manual_seed(seed)
    moe = MixtureOfExpertsFeedForward(MixtureOfExpertsFeedForward.Options(**options)).build(shape or make_shape(), 0)
    with torch.no_grad():  # weights large enough that every expert's output and every gate matter
        for p in moe.parameters():
            p.normal_(0.0, 0.5)
    return moe


def expert_mlp(moe, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert e on one token x (C,), written out."""
    h = x @ moe.w_in[e] + (moe.b_in[e, 0] if moe.b_in is not None else 0)
    if moe.activation == "swiglu":
        g, u = h.chunk(2)
        h = g * torch.sigmoid(g) * u
    else:
        h = 0.5 * h * (1 + torch.erf(h / math.sqrt(2)))
    return h @ moe.w_out[e] + (moe.b_out[e, 0] if moe.b_out is not None else 0)


def reference(moe, x: torch.Tensor, k: int, normalize: bool, capacity: int | None = None, order: str = "causal"):
    """One token at a time: softmax router, top-k, optional renormalisation, weighted sum of experts.
    With a capacity, choices are served in turn and those that find their expert full are dropped:
    ``"causal"`` serves position by position (batch rows in order within a position), each token's
    choices together, first choice first; ``"gshard"`` (the order the layer must not use) serves every
    token's first choice in token order, then every second choice. Returns the output and the dropped
    choices as (row, position, expert)."""
    B, T, _ = x.shape
    E = moe.n_experts
    choices = {}
    for b in range(B):
        for t in range(T):
            probs = torch.softmax(x[b, t] @ moe.router.weight.T, dim=0)
            top = sorted(range(E), key=lambda e: -probs[e].item())[:k]
            gates = [probs[e] for e in top]
            if normalize:
                gates = [g / sum(gates) for g in gates]
            choices[b, t] = list(zip(top, gates))
    if order == "causal":
        turns = [(b, t, c) for t in range(T) for b in range(B) for c in range(k)]
    else:
        turns = [(b, t, c) for c in range(k) for b in range(B) for t in range(T)]
    out, load, dropped = torch.zeros_like(x), [0] * E, []
    for b, t, c in turns:
        e, g = choices[b, t][c]
        if capacity is not None and load[e] >= capacity:
            dropped.append((b, t, e))
            continue
        load[e] += 1
        out[b, t] += g * expert_mlp(moe, e, x[b, t])
    return out, dropped


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("top_k", [1, 2, 3])
@pytest.mark.parametrize("bias", [False, True])
def test_moe_without_capacity_equals_the_per_token_reference(activation, top_k, bias):
    moe = build(make_shape(bias=bias), n_experts=4, top_k=top_k, activation=activation, capacity_factor=0)
    x = torch.randn(2, 7, D)
    expected, _ = reference(moe, x, top_k, normalize=top_k > 1)
    torch.testing.assert_close(moe.train()(x), expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(moe.eval()(x), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("top_k", [1, 2])
def test_capacity_drops_exactly_the_choices_beyond_each_experts_queue(top_k):
    moe = build(n_experts=4, top_k=top_k, capacity_factor=0.75)
    with torch.no_grad():
        moe.router.weight[0] += 2.0  # favour expert 0 so that its queue overflows
    x = torch.randn(2, 10, D) + 0.5
    capacity = math.ceil(0.75 * 20 * top_k / 4)
    expected, dropped = reference(moe, x, top_k, normalize=top_k > 1, capacity=capacity)
    assert len(dropped) >= 3
    if top_k == 2:  # the queue order matters here: GShard's would drop other choices
        assert reference(moe, x, top_k, normalize=True, capacity=capacity, order="gshard")[1] != dropped
    got = moe.train()(x)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert moe.stats["dropped_fraction"].item() == pytest.approx(len(dropped) / (20 * top_k))
    if top_k == 1:  # a dropped token's only expert is gone: the layer adds nothing to its residual
        for b, t, _ in dropped:
            assert not got[b, t].any()


def test_capacity_future_tokens_never_change_earlier_outputs_in_training():
    # The reported case: 4 experts, top-2, capacity factor 0.6; only positions >= 20 change.
    moe = build(n_experts=4, top_k=2, capacity_factor=0.6).train()
    x = torch.randn(2, 32, D)
    changed = x.clone()
    changed[:, 20:] = torch.randn(2, 12, D)
    capacity = math.ceil(0.6 * 64 * 2 / 4)
    expected, dropped = reference(moe, x, 2, normalize=True, capacity=capacity)
    assert any(t < 20 for _, t, _ in dropped)  # capacity is binding before the changed positions
    y, y_changed = moe(x), moe(changed)
    torch.testing.assert_close(y, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(y_changed[:, :20], y[:, :20], rtol=0, atol=0)
    assert not torch.allclose(y_changed[:, 20:], y[:, 20:])
    # GShard's order (every first choice, then every second) lets the later tokens reach back.
    gshard = [reference(moe, inputs, 2, normalize=True, capacity=capacity, order="gshard")[0][:, :20]
              for inputs in (x, changed)]
    assert (gshard[0] - gshard[1]).abs().max() > 1e-3


def test_default_is_dropless_in_training_however_unbalanced_the_router():
    moe = build(n_experts=4, top_k=2)
    assert moe.capacity_factor is None
    with torch.no_grad():
        moe.router.weight[0] += 2.0  # send most tokens to expert 0
    x = torch.randn(2, 10, D) + 0.5
    expected, _ = reference(moe, x, 2, normalize=True)
    torch.testing.assert_close(moe.train()(x), expected, rtol=1e-4, atol=1e-4)
    assert moe.stats["dropped_fraction"].item() == 0.0
    # Expert 0 got more choices than the former default capacity (factor 1.25) would have let it keep.
    assert moe.stats["expert_fraction"][0].item() * 40 > math.ceil(1.25 * 40 / 4)


def test_evaluation_never_drops():
    moe = build(n_experts=4, top_k=2, capacity_factor=0.5)
    x = torch.randn(2, 10, D)
    expected, _ = reference(moe, x, 2, normalize=True)
    torch.testing.assert_close(moe.eval()(x), expected, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(moe.train()(x), expected, atol=1e-3)  # while training it did drop


def test_aux_loss_equals_the_switch_formula_plus_z_loss():
    moe = build(n_experts=4, top_k=2, aux_loss_coef=0.01, router_z_loss_coef=0.001)
    x = torch.randn(3, 5, D)
    moe.train()(x)
    tokens = x.reshape(15, D)
    logits = tokens @ moe.router.weight.T
    probs = logits.softmax(-1)
    chosen = probs.topk(2, dim=-1).indices.flatten().tolist()
    f = [chosen.count(e) / len(chosen) for e in range(4)]   # share of all top-2 choices
    P = [probs[:, e].mean().item() for e in range(4)]
    balance = 4 * sum(fe * pe for fe, pe in zip(f, P))
    z = sum(torch.log(torch.exp(logits[t]).sum()).item() ** 2 for t in range(15)) / 15
    assert moe.stats["balance_loss"].item() == pytest.approx(balance, rel=1e-5)
    assert moe.stats["z_loss"].item() == pytest.approx(z, rel=1e-5)
    assert moe.aux_loss.item() == pytest.approx(0.01 * balance + 0.001 * z, rel=1e-5)
    assert moe.aux_loss.requires_grad and not moe.stats["balance_loss"].requires_grad
    moe.eval()(x)
    assert moe.aux_loss is None  # eval forwards report nothing the model could add to the loss


def test_balance_loss_is_one_for_a_uniform_router():
    moe = build(n_experts=4, top_k=1)
    with torch.no_grad():
        moe.router.weight.zero_()
    moe.train()(torch.randn(2, 6, D))
    assert moe.stats["balance_loss"].item() == pytest.approx(1.0)


def test_top1_is_switch_routing_scaled_by_the_router_probability():
    moe = build(n_experts=4, top_k=1, capacity_factor=0)
    x = torch.randn(2, 6, D)
    expected, _ = reference(moe, x, 1, normalize=False)
    torch.testing.assert_close(moe.train()(x), expected, rtol=1e-4, atol=1e-4)
    renormalised, _ = reference(moe, x, 1, normalize=True)  # gate 1: would leave the router without a gradient
    assert not torch.allclose(expected, renormalised, atol=1e-3)


def test_inference_top_k_routes_top1_in_eval_and_top2_in_training():
    moe = build(n_experts=4, top_k=2, inference_top_k=1, capacity_factor=0)
    x = torch.randn(2, 6, D)
    top2, _ = reference(moe, x, 2, normalize=True)
    top1, _ = reference(moe, x, 1, normalize=True)
    torch.testing.assert_close(moe.train()(x), top2, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(moe.eval()(x), top1, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(top1, top2, atol=1e-3)


def test_gradients_reach_the_router_and_exactly_the_experts_that_got_tokens():
    moe = build(n_experts=8, top_k=1, capacity_factor=0, aux_loss_coef=0.0).train()
    x = torch.randn(1, 3, D)  # 3 tokens, 8 experts: at least 5 experts idle
    (moe(x).square().sum() + moe.aux_loss).backward()
    used = set(moe.router.weight.detach().matmul(x[0].T).argmax(0).tolist())
    assert moe.router.weight.grad.abs().sum() > 0  # through the gate alone (no aux loss here)
    for e in range(8):
        received = e in used
        assert bool(moe.w_in.grad[e].any()) == received and bool(moe.w_out.grad[e].any()) == received


def test_top2_gradients_reach_the_router_and_every_used_expert():
    moe = build(n_experts=4, top_k=2).train()
    x = torch.randn(2, 8, D)
    (moe(x).square().sum() + moe.aux_loss).backward()
    assert moe.router.weight.grad.abs().sum() > 0
    received = moe.stats["expert_fraction"] > 0
    assert received.all()
    assert all(moe.w_in.grad[e].any() and moe.w_out.grad[e].any() for e in range(4))


def test_one_expert_top1_without_capacity_equals_the_dense_mlp():
    shape = make_shape(bias=True)
    moe = build(shape, n_experts=1, top_k=1, capacity_factor=0, hidden=24)
    (entry,) = md.entry_points(group="lmlab.ffn", name="mlp")
    cls = entry.load()
    mlp = cls(cls.Options(hidden=24)).build(shape, 0)
    with torch.no_grad():
        mlp.c_fc.weight.copy_(moe.w_in[0].T), mlp.c_fc.bias.copy_(moe.b_in[0, 0])
        mlp.c_proj.weight.copy_(moe.w_out[0].T), mlp.c_proj.bias.copy_(moe.b_out[0, 0])
    x = torch.randn(2, 5, D)
    torch.testing.assert_close(moe.train()(x), mlp(x), rtol=1e-5, atol=1e-5)


def test_default_expert_is_as_wide_as_the_dense_mlp_and_init_follows_gpt2():
    shape = make_shape(n_layers=8, d_model=64)
    torch.manual_seed(0)
    moe = MixtureOfExpertsFeedForward().build(shape, 0)
    assert moe.w_in.shape == (4, 64, 256) and moe.w_out.shape == (4, 256, 64) and moe.top_k == 2
    assert abs(moe.w_in.std().item() - shape.init_std) < 0.05 * shape.init_std
    assert abs(moe.w_out.std().item() - shape.residual_init_std) < 0.05 * shape.residual_init_std
    assert abs(moe.router.weight.std().item() - shape.init_std) < 0.2 * shape.init_std


def test_top_k_larger_than_the_number_of_experts_is_refused():
    with pytest.raises(UserError) as error:
        MixtureOfExpertsFeedForward(MixtureOfExpertsFeedForward.Options(n_experts=2, top_k=3)).build(make_shape(), 0)
    assert error.value.key == "ffn.top_k"
    with pytest.raises(ValueError, match="activation"):
        MixtureOfExpertsFeedForward.Options(activation="relu")


def test_router_runs_in_float32_under_autocast():
    moe = build(n_experts=4, top_k=2).train()
    x = torch.randn(2, 4, D)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = moe(x)
        route = moe.router(x.reshape(-1, D), 2, True)
    assert route.logits.dtype == torch.float32 and y.shape == x.shape
