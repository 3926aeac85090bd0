"""adafactor against torch.optim.Adafactor configured by hand on identical parameters and gradients."""

import torch

from lmlab.api import ParamInfo
from lmlab_optimizers.adafactor import Adafactor


def params():
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(6, 4, generator=g)), torch.nn.Parameter(torch.randn(4, generator=g))]


def grads(step):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(6, 4, generator=g), torch.randn(4, generator=g)]


def run(ps, optimizer, steps=3):
    for k in range(steps):
        for p, g in zip(ps, grads(k)):
            p.grad = g.clone()
        optimizer.step()


def test_three_steps_equal_torch_adafactor_configured_by_hand():
    ours, theirs = params(), params()
    opt = Adafactor(Adafactor.Options(lr=0.05, beta2_decay=-0.7, eps1=1e-20, eps2=1e-2, d=1.5, weight_decay=0.2)).build(
        [ParamInfo("w", ours[0], decay=True), ParamInfo("b", ours[1], decay=False)])
    ref = torch.optim.Adafactor([{"params": [theirs[0]], "weight_decay": 0.2},
                                 {"params": [theirs[1]], "weight_decay": 0.0}],
                                lr=0.05, beta2_decay=-0.7, eps=(1e-20, 1e-2), d=1.5)
    run(ours, opt)
    run(theirs, ref)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
    assert not torch.equal(ours[0], params()[0])


def test_defaults_are_torchs():
    ours, theirs = params(), params()
    run(ours, Adafactor().build([ParamInfo("w", ours[0], decay=True), ParamInfo("b", ours[1], decay=False)]))
    run(theirs, torch.optim.Adafactor(theirs))
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)


def test_a_matrix_keeps_factored_second_moments():
    ps = params()
    opt = Adafactor().build([ParamInfo("w", ps[0], decay=True), ParamInfo("b", ps[1], decay=False)])
    run(ps, opt, steps=1)
    matrix, vector = opt.state[ps[0]], opt.state[ps[1]]
    assert matrix["row_var"].shape == (6, 1) and matrix["col_var"].shape == (1, 4) and "variance" not in matrix
    assert vector["variance"].shape == (4,)
