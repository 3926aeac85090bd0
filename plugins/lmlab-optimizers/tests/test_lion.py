"""lion against the paper's rule (Chen et al. 2023, Algorithm 2) computed by hand with plain tensor math."""

import pytest
import torch

from lmlab.api import ParamInfo
from lmlab_optimizers.lion import Lion


def params():
    g = torch.Generator().manual_seed(0)
    return {"w": torch.nn.Parameter(torch.randn(4, 3, generator=g)),  # a matrix: decays
            "b": torch.nn.Parameter(torch.randn(3, generator=g))}     # a vector: no decay


def grads(step):
    g = torch.Generator().manual_seed(100 + step)
    return {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}


def by_hand(theta, steps, lr, beta1, beta2, weight_decay):
    """θ ← θ − lr·(sign(β1·m + (1 − β1)·g) + λ·θ); m ← β2·m + (1 − β2)·g; no decay for the vector."""
    theta = {n: t.detach().clone() for n, t in theta.items()}
    m = {n: torch.zeros_like(t) for n, t in theta.items()}
    for k in range(steps):
        for n, g in grads(k).items():
            lam = weight_decay if n == "w" else 0.0
            c = beta1 * m[n] + (1 - beta1) * g
            theta[n] = theta[n] - lr * (torch.sign(c) + lam * theta[n])
            m[n] = beta2 * m[n] + (1 - beta2) * g
    return theta


@pytest.mark.parametrize("weight_decay", [0.5, 0.0])
def test_three_steps_follow_the_papers_rule(weight_decay):
    ps = params()
    expected = by_hand(ps, 3, lr=0.01, beta1=0.8, beta2=0.95, weight_decay=weight_decay)
    opt = Lion(Lion.Options(lr=0.01, betas=(0.8, 0.95), weight_decay=weight_decay)).build(
        [ParamInfo("w", ps["w"], decay=True), ParamInfo("b", ps["b"], decay=False)])
    for k in range(3):
        for n, g in grads(k).items():
            ps[n].grad = g
        opt.step()
    for n in ps:
        torch.testing.assert_close(ps[n].detach(), expected[n], rtol=0, atol=1e-6)
    assert (ps["w"] - params()["w"]).abs().max() > 0.009  # it moved by steps of lr: no vacuous pass


def test_one_momentum_buffer_per_parameter_and_two_decay_groups():
    ps = params()
    opt = Lion(Lion.Options(weight_decay=0.3)).build(
        [ParamInfo("w", ps["w"], decay=True), ParamInfo("b", ps["b"], decay=False)])
    assert [(g["weight_decay"], len(g["params"])) for g in opt.param_groups] == [(0.3, 1), (0.0, 1)]
    for n, g in grads(0).items():
        ps[n].grad = g
    opt.step()
    assert {k for s in opt.state.values() for k in s} == {"exp_avg"}


def test_a_parameter_without_gradient_is_left_alone():
    ps = params()
    before = ps["b"].detach().clone()
    opt = Lion(Lion.Options(weight_decay=0.3)).build(
        [ParamInfo("w", ps["w"], decay=True), ParamInfo("b", ps["b"], decay=True)])
    ps["w"].grad = grads(0)["w"]
    opt.step()
    assert torch.equal(ps["b"], before) and ps["b"] not in opt.state


def test_betas_outside_the_unit_interval_are_refused():
    with pytest.raises(ValueError, match="beta"):
        Lion.Options(betas=(0.9, 1.0))
