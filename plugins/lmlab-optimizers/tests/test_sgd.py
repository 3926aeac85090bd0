"""sgd against torch.optim.SGD configured by hand on identical parameters and gradients."""

import pytest
import torch

from lmlab.api import ParamInfo, UserError
from lmlab_optimizers.sgd import SGD


def params():
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(4, 3, generator=g)), torch.nn.Parameter(torch.randn(3, generator=g))]


def grads(step):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(4, 3, generator=g), torch.randn(3, generator=g)]


@pytest.mark.parametrize("options", [{"nesterov": True}, {"dampening": 0.5}, {"momentum": 0.0}],
                         ids=["nesterov", "dampening", "plain"])
def test_three_steps_equal_torch_sgd_configured_by_hand(options):
    ours, theirs = params(), params()
    opt = SGD(SGD.Options(lr=0.05, weight_decay=0.01, **options)).build(
        [ParamInfo("w", ours[0], decay=True), ParamInfo("b", ours[1], decay=False)])
    ref = torch.optim.SGD([{"params": [theirs[0]], "weight_decay": 0.01}, {"params": [theirs[1]], "weight_decay": 0.0}],
                          lr=0.05, momentum=options.get("momentum", 0.9), dampening=options.get("dampening", 0.0),
                          nesterov=options.get("nesterov", False))
    for k in range(3):
        for ps, optimizer in ((ours, opt), (theirs, ref)):
            for p, g in zip(ps, grads(k)):
                p.grad = g.clone()
            optimizer.step()
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
    assert not torch.equal(ours[0], params()[0])


def test_defaults_are_momentum_without_weight_decay():
    opt = SGD().build([ParamInfo("w", params()[0], decay=True)])
    (group,) = opt.param_groups
    assert (group["lr"], group["momentum"], group["nesterov"], group["weight_decay"]) == (0.1, 0.9, False, 0.0)


def test_nesterov_needs_momentum_and_no_dampening():
    with pytest.raises(UserError, match="nesterov"):
        SGD(SGD.Options(nesterov=True, momentum=0.0))
    with pytest.raises(UserError, match="nesterov"):
        SGD(SGD.Options(nesterov=True, dampening=0.1))


def test_fused_and_foreach_together_is_a_user_error():
    with pytest.raises(UserError, match="fused"):
        SGD(SGD.Options(fused=True, foreach=True))
