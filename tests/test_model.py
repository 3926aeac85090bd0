"""The assembled model, for every installed attention × position × ffn plugin: causal, and cached
decoding equals the full forward pass."""

import itertools

import pytest
import torch

from lmlab import discovery
from lmlab.api import MixerContext, ModelShape, UserError
from lmlab.model import LanguageModel

SHAPE = ModelShape(n_layers=2, d_model=32, n_heads=4, block_size=24, vocab_size=37)


def installed(slot):
    return sorted({p.name for p in discovery.installed()[slot]})


COMBOS = list(itertools.product(installed("attention"), installed("position"), installed("ffn")))


def build(attention, position, ffn, norm="layernorm", seed=0):
    torch.manual_seed(seed)
    plugins = {slot: discovery.load(slot, name)() for slot, name in
               (("attention", attention), ("position", position), ("ffn", ffn))}
    model = LanguageModel(SHAPE, norm=norm, **plugins).eval()
    try:  # a mixer may refuse a position scheme it cannot use (mamba with rope): not this test's subject
        with torch.no_grad():
            model(torch.zeros(1, 2, dtype=torch.long))
    except UserError as exc:
        pytest.skip(f"{attention} refuses {position}: {exc}")
    return model


@pytest.mark.parametrize("attention, position, ffn", COMBOS)
def test_outputs_before_t_ignore_tokens_after_t(attention, position, ffn):
    model = build(attention, position, ffn)
    idx = torch.randint(0, SHAPE.vocab_size, (2, 20))
    changed = idx.clone()
    changed[:, 11:] = torch.randint(0, SHAPE.vocab_size, (2, 9))
    with torch.no_grad():
        a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :11], b[:, :11], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 11:], b[:, 11:])


@pytest.mark.parametrize("attention, position, ffn", COMBOS)
def test_cached_decoding_equals_the_full_forward(attention, position, ffn):
    model = build(attention, position, ffn, norm="rmsnorm")
    idx = torch.randint(0, SHAPE.vocab_size, (3, 20))
    with torch.no_grad():
        full = model(idx)
        cache = model.new_cache(3, 20)
        pieces = [model(idx[:, :7], cache=cache)]  # prefill
        pieces += [model(idx[:, t:t + 1], cache=cache) for t in range(7, 12)]  # one token at a time
        pieces.append(model(idx[:, 12:20], cache=cache))  # a chunk after the cache holds tokens
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)
    assert cache.length == 20


def test_positions_beyond_a_bounded_scheme_are_refused_clearly():
    model = build("mha", "learned", "mlp")
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, SHAPE.block_size + 1, dtype=torch.long))


def test_tied_head_shares_the_embedding_and_is_not_decayed():
    model = build("mha", "learned", "mlp")
    assert model.head.weight is model.tok_emb.weight
    decay = {i.name: i.decay for i in model.param_infos()}
    assert decay["tok_emb.weight"] is False and decay["position.wpe.weight"] is False
    assert not any(decay[n] for n in decay if n.endswith(".bias") or "norm" in n)
    assert sum(decay.values()) == sum(1 for n, p in model.named_parameters() if p.dim() == 2) - 2


def test_residual_projections_get_the_scaled_init():
    torch.manual_seed(0)
    shape = ModelShape(n_layers=8, d_model=256, n_heads=4, block_size=8, vocab_size=11)
    plugins = {s: discovery.load(s, n)() for s, n in (("attention", "mha"), ("position", "learned"), ("ffn", "mlp"))}
    model = LanguageModel(shape, **plugins)
    stds = sorted(p.std().item() for n, p in model.named_parameters() if p.dim() == 2 and n.startswith("blocks.0."))
    assert stds[0] == pytest.approx(shape.residual_init_std, rel=0.1)
    assert stds[-1] == pytest.approx(shape.init_std, rel=0.1)


@pytest.mark.parametrize("policy", ["full", "attention", "ffn"])
def test_activation_checkpointing_changes_memory_not_math(policy):
    from dataclasses import replace

    def loss_and_grads(policy):
        torch.manual_seed(0)
        plugins = {s: discovery.load(s, n)() for s, n in (("attention", "mha"), ("position", "learned"), ("ffn", "mlp"))}
        model = LanguageModel(replace(SHAPE, dropout=0.2), **plugins)
        model.set_checkpointing(policy)
        idx = torch.randint(0, SHAPE.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
        torch.manual_seed(5)  # dropout masks: recomputation must replay the same ones
        loss = model(idx).logsumexp(-1).mean()
        loss.backward()
        return loss, {n: p.grad for n, p in model.named_parameters()}

    ref_loss, ref_grads = loss_and_grads("none")
    loss, grads = loss_and_grads(policy)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-6, atol=1e-7, msg=name)


def test_checkpointing_saves_fewer_activations():
    def saved_bytes(policy):
        torch.manual_seed(0)
        model = build("mha", "learned", "mlp").train()
        model.set_checkpointing(policy)
        total = 0

        def pack(t):
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(torch.randint(0, SHAPE.vocab_size, (4, 24))).sum()
        return total

    none, ffn, full = saved_bytes("none"), saved_bytes("ffn"), saved_bytes("full")
    assert full < ffn < none


def test_parameters_marked_no_weight_decay_are_not_decayed():
    model = build("mamba", "none", "mlp")
    decay = {i.name: i.decay for i in model.param_infos()}
    assert decay["blocks.0.attn.A_log"] is False and decay["blocks.0.attn.in_proj.weight"] is True


def test_ffn_none_leaves_mixer_only_blocks():
    with_mlp, without = build("mha", "learned", "mlp"), build("mha", "learned", "none")
    names = {n for n, _ in without.named_parameters()}
    assert not any(".norm2." in n or ".ffn." in n for n in names)
    assert names < {n for n, _ in with_mlp.named_parameters()}
    with torch.no_grad():  # the block is x + attn(norm1(x)) and nothing more
        x = torch.randn(2, 5, SHAPE.d_model)
        block = without.blocks[0]
        ctx = MixerContext(without.position, torch.arange(5))
        torch.testing.assert_close(block(x, ctx), x + block.attn(block.norm1(x), ctx))
