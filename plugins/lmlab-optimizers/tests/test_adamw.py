import pytest
import torch

from lmlab.api import ParamInfo, UserError
from lmlab_optimizers.adamw import AdamW


def tiny_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))


def infos(model):
    # The core's rule, reproduced here: only 2-D weights of linear layers decay.
    return [ParamInfo(n, p, decay=p.dim() >= 2 and not n.startswith("0.")) for n, p in model.named_parameters()]


def adamw(**options):
    return AdamW(AdamW.Options(**options))


def test_decay_and_no_decay_params_go_to_groups_with_their_weight_decay():
    model = tiny_model()
    opt = adamw(weight_decay=0.05).build(infos(model))
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    assert [id(p) for p in decay["params"]] == [id(model[1].weight)]
    assert {id(p) for p in no_decay["params"]} == {
        id(model[0].weight), id(model[1].bias), id(model[2].weight), id(model[2].bias)}


def test_an_empty_group_is_omitted():
    model = tiny_model()
    opt = adamw().build([ParamInfo(n, p, decay=False) for n, p in model.named_parameters()])
    assert len(opt.param_groups) == 1 and opt.param_groups[0]["weight_decay"] == 0.0


def two_steps(model, optimizer):
    x = torch.randint(0, 10, (4, 3), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()


@pytest.mark.parametrize("implementation", [{}, {"fused": False}, {"foreach": True}])
def test_two_steps_equal_torch_adamw_configured_by_hand(implementation):
    """Unset, the update is torch's fused kernel (on the CPU torch would loop over the tensors);
    either way it is torch's AdamW with the same groups."""
    ours, theirs, plain = tiny_model(), tiny_model(), tiny_model()
    opt = adamw(lr=1e-2, betas=[0.8, 0.9], eps=1e-6, weight_decay=0.2, **implementation).build(infos(ours))
    assert opt.defaults["fused"] is (True if not implementation else None if "foreach" in implementation else False)

    def reference(model, **kw):
        decay = [p for i, p in zip(infos(model), model.parameters()) if i.decay]
        rest = [p for i, p in zip(infos(model), model.parameters()) if not i.decay]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.2}, {"params": rest, "weight_decay": 0.0}],
                                 lr=1e-2, betas=(0.8, 0.9), eps=1e-6, **kw)

    two_steps(ours, opt)
    two_steps(theirs, reference(theirs, **({"fused": True} if not implementation else implementation)))
    two_steps(plain, reference(plain))
    for a, b, c in zip(ours.parameters(), theirs.parameters(), plain.parameters()):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, rtol=1e-6, atol=1e-7)  # the implementations agree to rounding
    assert not torch.equal(ours[1].weight, tiny_model()[1].weight)  # it did move


def test_weight_decay_shrinks_only_the_decay_group():
    model = tiny_model()
    before = [p.detach().clone() for p in model.parameters()]
    opt = adamw(lr=0.1, weight_decay=0.5).build(infos(model))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # no gradient: any change is the decay
    opt.step()
    for info, p, b in zip(infos(model), model.parameters(), before):
        assert torch.allclose(p, b * (1 - 0.1 * 0.5)) if info.decay else torch.equal(p, b)


def test_betas_outside_the_unit_interval_are_refused():
    with pytest.raises(ValueError, match="betas"):
        AdamW.Options(betas=(0.9, 1.0))


def test_fused_and_foreach_together_is_a_user_error():
    with pytest.raises(UserError, match="fused"):
        adamw(fused=True, foreach=True)
