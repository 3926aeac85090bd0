"""lamb against the paper's rule (You et al. 2020, Algorithm 2) computed by hand with plain tensor math:
Adam's bias-corrected moments, weight decay in the update, the trust ratio φ(‖θ‖)/‖r‖ (1 when a norm is
0), and no decay nor trust ratio for parameters the core does not decay."""

import pytest
import torch

from lmlab.api import ParamInfo
from lmlab_optimizers.lamb import LAMB

LR, BETAS, EPS, WD = 0.01, (0.8, 0.9), 1e-6, 0.1


def params():
    g = torch.Generator().manual_seed(0)
    return {"w": torch.nn.Parameter(torch.randn(4, 3, generator=g)),  # decays, trust ratio
            "z": torch.nn.Parameter(torch.zeros(3, 3)),               # decays, starts at norm 0: ratio 1
            "dead": torch.nn.Parameter(torch.zeros(2, 2)),            # norm 0 and no gradient ever: ‖r‖ = 0
            "b": torch.nn.Parameter(torch.randn(5, generator=g))}     # no decay: plain Adam


DECAY = {"w": True, "z": True, "dead": True, "b": False}


def grads(step):
    g = torch.Generator().manual_seed(100 + step)
    return {"w": torch.randn(4, 3, generator=g), "z": torch.randn(3, 3, generator=g),
            "dead": torch.zeros(2, 2), "b": torch.randn(5, generator=g)}


def by_hand(theta, steps, clamp=None, adapt_no_decay=False):
    theta = {n: t.detach().clone() for n, t in theta.items()}
    m = {n: torch.zeros_like(t) for n, t in theta.items()}
    v = {n: torch.zeros_like(t) for n, t in theta.items()}
    beta1, beta2 = BETAS
    for t in range(1, steps + 1):
        for n, g in grads(t - 1).items():
            m[n] = beta1 * m[n] + (1 - beta1) * g
            v[n] = beta2 * v[n] + (1 - beta2) * g * g
            m_hat, v_hat = m[n] / (1 - beta1 ** t), v[n] / (1 - beta2 ** t)
            r = m_hat / (v_hat.sqrt() + EPS)
            if DECAY[n]:
                r = r + WD * theta[n]
            ratio = 1.0
            if DECAY[n] or adapt_no_decay:
                w_norm, r_norm = theta[n].norm(), r.norm()
                phi = w_norm if clamp is None else w_norm.clamp(*clamp)
                ratio = phi / r_norm if w_norm > 0 and r_norm > 0 else 1.0
            theta[n] = theta[n] - LR * ratio * r
    return theta


def run(steps, **options):
    ps = params()
    opt = LAMB(LAMB.Options(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **options)).build(
        [ParamInfo(n, p, decay=DECAY[n]) for n, p in ps.items()])
    for k in range(steps):
        for n, g in grads(k).items():
            ps[n].grad = g
        opt.step()
    return ps


@pytest.mark.parametrize("options", [{}, {"weight_norm_clamp": (0.0, 0.5)}, {"adapt_no_decay": True}],
                         ids=["default", "clamp", "adapt_no_decay"])
def test_three_steps_follow_the_papers_rule(options):
    ps = run(3, **options)
    expected = by_hand(params(), 3, clamp=options.get("weight_norm_clamp"),
                       adapt_no_decay=options.get("adapt_no_decay", False))
    for n in ps:
        torch.testing.assert_close(ps[n].detach(), expected[n], rtol=1e-5, atol=1e-7)


def test_the_zero_parameters_move_or_stay_as_the_rule_says():
    ps = run(3)
    assert ps["z"].norm() > 0  # ratio 1 at the first step, from norm 0
    assert torch.equal(ps["dead"], torch.zeros(2, 2))  # ‖θ‖ = ‖r‖ = 0: ratio 1, no NaN
    # the trust ratio makes each step of w move it by lr·‖w‖ (‖ratio·r‖ = ‖w‖)
    first = run(1)
    assert torch.isclose((first["w"] - params()["w"]).norm(), LR * params()["w"].norm(), rtol=1e-5)


def test_the_no_decay_group_is_plain_adam_without_weight_decay():
    ps = params()
    ref = {n: torch.nn.Parameter(p.detach().clone()) for n, p in ps.items()}
    opt = LAMB(LAMB.Options(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)).build(
        [ParamInfo("b", ps["b"], decay=False)])
    adam = torch.optim.Adam([ref["b"]], lr=LR, betas=BETAS, eps=EPS)
    assert opt.param_groups[0]["weight_decay"] == 0 and opt.param_groups[0]["trust_ratio"] is False
    for k in range(3):
        ps["b"].grad = ref["b"].grad = grads(k)["b"]
        opt.step()
        adam.step()
    torch.testing.assert_close(ps["b"].detach(), ref["b"].detach(), rtol=1e-6, atol=1e-7)


def test_the_options_are_checked():
    with pytest.raises(ValueError, match="weight_norm_clamp"):
        LAMB.Options(weight_norm_clamp=(1.0, 0.5))
    with pytest.raises(ValueError, match="beta"):
        LAMB.Options(betas=(1.0, 0.9))
