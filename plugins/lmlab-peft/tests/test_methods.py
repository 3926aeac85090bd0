"""Every peft plugin against the kit (starts as the base, trains only its adapter, adapter round trip,
merges exactly), and the properties of each method that the kit cannot know."""

import pytest
import torch

from lmlab.api import UserError
from lmlab.testing import check_plugin_class
from lmlab.testing.peft import adapted, check_peft, perturb, probe
from lmlab_peft.adalora import AdaLoRA
from lmlab_peft.adapter import BottleneckAdapter
from lmlab_peft.ia3 import IA3
from lmlab_peft.loha import LoHa
from lmlab_peft.lokr import LoKr
from lmlab_peft.lora import DoRA, LoRA
from lmlab_peft.none import NoPeft

METHODS = {
    "lora": (LoRA, {"r": 4, "alpha": 8.0, "targets": "all"}),
    "dora": (DoRA, {"r": 4, "targets": ["q", "k", "v", "o", "up", "down"]}),
    "ia3": (IA3, {}),
    "loha": (LoHa, {"r": 4, "targets": ["q", "v", "down"]}),
    "lokr": (LoKr, {"r": 4, "targets": ["q", "v", "down"]}),
    "adalora": (AdaLoRA, {"init_r": 6, "target_r": 2, "targets": ["q", "v", "up"]}),
    "adapter": (BottleneckAdapter, {"size": 8}),
    "none": (NoPeft, {}),
}


@pytest.mark.parametrize("name", list(METHODS))
def test_method_meets_the_peft_contract(name):
    cls, options = METHODS[name]
    check_plugin_class(cls, "peft")
    check_peft(cls, options)


@pytest.mark.parametrize("name", ["lora", "adapter"])
def test_a_fresh_adapter_leaves_the_outputs_exactly_unchanged(name):
    cls, options = METHODS[name]
    _, base, model = adapted(cls, options, "gqa", "swiglu")
    x = probe()
    with torch.no_grad():
        assert torch.equal(model(x), base(x))  # B = 0 / W_up = 0: the update adds exact zeros


@pytest.mark.parametrize("rslora", [False, True])
def test_lora_equals_w_plus_scaled_b_a_on_one_layer(rslora):
    plugin, base, model = adapted(LoRA, {"r": 4, "alpha": 12.0, "targets": ["q"], "rslora": rslora})
    layer = model.blocks[1].attn.q_proj
    A, B = layer.lora_A["default"].weight, layer.lora_B["default"].weight          # (r, in), (out, r)
    perturb(plugin, model)
    W = base.blocks[1].attn.q_proj.weight                                          # (out, in)
    scale = 12.0 / (4 ** 0.5 if rslora else 4)
    x = torch.randn(3, 5, W.shape[1], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = x @ (W + scale * B @ A).T
        assert (layer(x) - expected).abs().max().item() <= 1e-5
        assert B.abs().max() > 0.05  # the update is really there
        plugin.merge(model)
        assert torch.allclose(model.blocks[1].attn.q_proj.weight, W + scale * B @ A, atol=1e-6)


def test_merged_lora_equals_unmerged():
    plugin, base, model = adapted(LoRA, {"r": 8, "alpha": 16.0, "targets": "all"}, "gqa", "swiglu")
    perturb(plugin, model, scale=0.3)
    x = probe()
    with torch.no_grad():
        unmerged = model(x)
        plugin.merge(model)
        merged = model(x)
        assert (merged - base(x)).abs().max().item() > 1e-2
    assert set(model.state_dict()) == set(base.state_dict())
    assert (merged - unmerged).abs().max().item() <= 1e-5


def test_only_adapter_parameters_receive_gradients():
    plugin, _, model = adapted(LoRA, {"targets": ["q", "v", "down"]})
    perturb(plugin, model)
    model(probe()).logsumexp(-1).mean().backward()
    graded = {n for n, p in model.named_parameters() if p.grad is not None}
    assert graded and all(".lora_A.default." in n or ".lora_B.default." in n for n in graded)
    assert len(graded) == 2 * 3 * 2  # A and B, three roles, two blocks


def test_a_target_that_matches_no_module_lists_the_roles_that_exist():
    with pytest.raises(UserError) as error:
        adapted(LoRA, {"targets": ["q", "gate"]}, "gqa", "mlp")
    assert error.value.key == "peft.targets"
    assert "role 'gate' matches no module" in str(error.value)
    assert "attention: q, k, v, o; ffn: up, down" in str(error.value)


def test_roles_reach_mamba_and_the_adapter_reaches_moe():
    check_peft(LoRA, {"targets": ["in", "x", "o"]}, architectures=[("mamba", "mlp")])
    check_peft(BottleneckAdapter, {}, architectures=[("mamba", "moe"), ("gqa", "moe")])
    with pytest.raises(UserError, match="ffn: \\(none\\)"):
        adapted(LoRA, {"targets": ["up"]}, "gqa", "moe")


def test_ia3_scales_only_target_roles_and_feedforward_must_be_one_of_them():
    plugin, _, model = adapted(IA3, {})
    assert model.blocks[0].ffn.c_proj.is_feedforward and not model.blocks[0].attn.k_proj.is_feedforward
    assert model.blocks[0].ffn.c_proj.ia3_l["default"].shape == (1, model.blocks[0].ffn.c_proj.in_features)
    with pytest.raises(UserError, match="not among the targets") as error:
        adapted(IA3, {"targets": ["k", "v"], "feedforward": ["down"]})
    assert error.value.key == "peft.feedforward"


def test_adalora_prunes_to_its_target_budget_and_refuses_a_schedule_without_room():
    plugin, _, model = adapted(AdaLoRA, {"init_r": 6, "target_r": 2, "tinit": 1, "tfinal": 3, "total_step": 12})
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for step in range(1, 13):
        loss = model(probe()).logsumexp(-1).mean() + plugin.regularization(model)
        loss.backward()
        optimizer.step()
        plugin.lmlab_train_batch_end(step)  # what the run does after each optimizer step
        optimizer.zero_grad()
    kept = sum(int((p != 0).sum()) for n, p in model.named_parameters() if "lora_E" in n)
    assert kept == 2 * 2 * 2  # target_r x (q, v) x two blocks
    with pytest.raises(UserError) as error:
        adapted(AdaLoRA, {"tinit": 15, "tfinal": 5})  # the kit's 20 steps
    assert error.value.key == "peft.tinit"


def test_adapter_sits_after_attention_and_ffn_with_its_bottleneck_width():
    plugin, _, model = adapted(BottleneckAdapter, {})
    block = model.blocks[0]
    assert block.attn_adapter.down.out_features == 32 // 16
    assert set(n.split(".")[2] for n, p in model.named_parameters() if p.requires_grad) == {"attn_adapter",
                                                                                           "ffn_adapter"}
    _, _, only_attention = adapted(BottleneckAdapter, {"after": ["attention"]})
    assert not hasattr(only_attention.blocks[0], "ffn_adapter")
    with pytest.raises(UserError, match="cannot fold"):
        plugin.merge(model)


def test_every_method_refuses_sharded_and_split_layouts():
    for cls, _ in METHODS.values():
        if cls is NoPeft:
            assert cls.parallel is None
        else:
            assert cls.parallel == ("single", "ddp")
