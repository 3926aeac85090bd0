"""muon: which parameters Muon trains, the update against torch.optim.Muon and torch.optim.AdamW
configured by hand, and the joint optimizer as the core's schedule and checkpoints use it."""

import io

import pytest
import torch

from lmlab.api import ModelShape, ParamInfo
from lmlab.testing.reference import ReferencePosition, reference_model
from lmlab_optimizers.muon import Muon, MuonWithAdamW

SHAPE = ModelShape(n_layers=2, d_model=16, n_heads=2, block_size=8, vocab_size=11)


def model():
    torch.manual_seed(0)
    return reference_model(SHAPE, ReferencePosition())


def set_grads(m, step):
    g = torch.Generator().manual_seed(100 + step)
    for p in m.parameters():
        p.grad = torch.randn(p.shape, generator=g)


def test_muon_takes_the_block_matrices_and_adamw_the_rest():
    m = model()
    opt = Muon().build(m.param_infos())
    muon, adamw = opt.optimizers
    names = {id(p): n for n, p in m.named_parameters()}
    muon_names = {names[id(p)] for g in muon.param_groups for p in g["params"]}
    parts = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.out_proj", "ffn.up", "ffn.down")
    assert muon_names == {f"blocks.{i}.{part}.weight" for i in range(2) for part in parts}
    adamw_names = {names[id(p)] for g in adamw.param_groups for p in g["params"]}
    assert "tok_emb.weight" in adamw_names and all("norm" in n or n == "tok_emb.weight" for n in adamw_names)
    assert opt.param_groups == muon.param_groups + adamw.param_groups
    assert opt.param_groups[0]["lr"] == 0.02  # the peak the core reads is Muon's


def test_an_untied_head_experts_and_no_decay_matrices_go_to_adamw():
    p = {n: torch.nn.Parameter(torch.zeros(shape)) for n, shape in [
        ("tok_emb.weight", (11, 4)), ("blocks.0.attn.q_proj.weight", (4, 4)), ("blocks.0.norm1.weight", (4,)),
        ("blocks.0.ffn.experts.w1", (2, 4, 8)), ("blocks.0.attn.A_log", (4, 2)), ("head.weight", (11, 4))]}
    decay = {"tok_emb.weight": False, "blocks.0.norm1.weight": False, "blocks.0.attn.A_log": False}
    opt = Muon().build([ParamInfo(n, t, decay=decay.get(n, True)) for n, t in p.items()])
    muon, adamw = opt.optimizers
    assert [q for g in muon.param_groups for q in g["params"]] == [p["blocks.0.attn.q_proj.weight"]]
    decayed, not_decayed = adamw.param_groups
    assert decayed["params"] == [p["blocks.0.ffn.experts.w1"], p["head.weight"]] and decayed["weight_decay"] == 0.1
    assert not_decayed["weight_decay"] == 0.0 and len(not_decayed["params"]) == 3


def test_three_steps_equal_torch_muon_and_adamw_configured_by_hand():
    ours, theirs = model(), model()
    options = Muon.Options(lr=0.03, momentum=0.9, weight_decay=0.05, adjust_lr="match_rms_adamw", ns_steps=4,
                           adamw_lr=2e-3, adamw_betas=(0.8, 0.99), adamw_eps=1e-6, adamw_weight_decay=0.2)
    opt = Muon(options).build(ours.param_infos())
    infos = theirs.param_infos()
    matrices = [i.param for i in infos if i.param.ndim == 2 and i.decay and i.name.startswith("blocks.")]
    rest = [i for i in infos if i.param not in set(matrices)]
    groups = [{"params": [i.param for i in rest if i.decay], "weight_decay": 0.2},
              {"params": [i.param for i in rest if not i.decay], "weight_decay": 0.0}]
    ref = [torch.optim.Muon(matrices, lr=0.03, momentum=0.9, weight_decay=0.05, adjust_lr_fn="match_rms_adamw",
                            ns_steps=4),
           torch.optim.AdamW([g for g in groups if g["params"]], lr=2e-3, betas=(0.8, 0.99), eps=1e-6)]
    for k in range(3):
        set_grads(ours, k)
        set_grads(theirs, k)
        opt.step()
        for o in ref:
            o.step()
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        assert torch.equal(a, b), name
    assert not torch.equal(ours.blocks[0].attn.q_proj.weight, model().blocks[0].attn.q_proj.weight)


def test_the_schedule_scales_every_group_of_both_optimizers():
    m = model()
    opt = Muon().build(m.param_infos())
    torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)
    muon, adamw = opt.optimizers
    assert [g["lr"] for g in muon.param_groups] == [0.01]
    assert [g["lr"] for g in adamw.param_groups] == [5e-4] * len(adamw.param_groups)


def test_state_is_routed_to_the_optimizer_holding_the_parameter():
    m = model()
    opt = Muon().build(m.param_infos())
    set_grads(m, 0)
    opt.step()
    q, emb = m.blocks[0].attn.q_proj.weight, m.tok_emb.weight
    assert set(opt.state[q]) == {"momentum_buffer"} and {"exp_avg", "exp_avg_sq"} <= set(opt.state[emb])
    assert len(opt.state) == len(list(m.parameters())) and q in opt.state
    moved = {k: v.clone() for k, v in opt.state[q].items()}
    opt.state[q] = moved  # what Lightning's _optimizer_to_device does after loading a checkpoint
    assert opt.optimizers[0].state[q] is moved
    opt.zero_grad()
    assert all(p.grad is None for p in m.parameters())


def test_the_state_dict_has_torchs_layout_and_resumes_bit_identically():
    m = model()
    opt = Muon().build(m.param_infos())
    torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)
    for k in range(2):
        set_grads(m, k)
        opt.step()
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    assert set(saved) == {"state", "param_groups"} and len(saved["state"]) == len(list(m.parameters()))
    resumed = model()
    resumed.load_state_dict(m.state_dict())
    other = Muon().build(resumed.param_infos())
    other.load_state_dict(saved)
    assert [g["lr"] for g in other.param_groups] == [g["lr"] for g in opt.param_groups]
    assert other.param_groups == other.optimizers[0].param_groups + other.optimizers[1].param_groups
    for k in range(2, 4):
        set_grads(m, k)
        set_grads(resumed, k)
        opt.step()
        other.step()
    for a, b in zip(m.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_a_state_dict_of_other_groups_is_refused():
    opt = Muon().build(model().param_infos())
    saved = opt.state_dict()
    with pytest.raises(ValueError, match="param groups"):
        opt.load_state_dict({"state": {}, "param_groups": saved["param_groups"][:1]})


def test_without_block_matrices_it_is_adamw_alone():
    m = torch.nn.Linear(3, 3)
    opt = Muon().build([ParamInfo("head.weight", m.weight, decay=True), ParamInfo("head.bias", m.bias, decay=False)])
    assert isinstance(opt, MuonWithAdamW) and [type(o) for o in opt.optimizers] == [torch.optim.AdamW]
