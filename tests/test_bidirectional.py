"""The causal/bidirectional switch: the model built for a non-causal objective, the refusal of mixers
that cannot do it, the [MASK] id and vocabulary, and the conformance kit's bidirectional check."""

import pytest
import torch

from lmlab import discovery
from lmlab.api import Attention, ModelShape, MixerContext, Objective, UserError
from lmlab.model import LanguageModel
from lmlab.testing import ConformanceError, check_attention, iter_checks
from lmlab.testing.reference import ReferenceAttention, ReferenceAttentionModule
from lmlab.assemble import build_model, vocabulary
from lmlab.config import ModelOptions

SHAPE = ModelShape(n_layers=2, d_model=32, n_heads=4, block_size=16, vocab_size=23)


def model(attention: str, position: str, causal: bool, seed: int = 0) -> LanguageModel:
    torch.manual_seed(seed)
    plugins = {slot: discovery.load(slot, name)() for slot, name in
               (("attention", attention), ("position", position), ("ffn", "mlp"))}
    return LanguageModel(SHAPE, **plugins, causal=causal).eval()


@pytest.mark.parametrize("position", ["learned", "rope", "alibi", "none"])
@pytest.mark.parametrize("attention", ["gqa", "mha"])
def test_a_later_token_changes_earlier_outputs_only_in_a_bidirectional_model(attention, position):
    idx = torch.randint(0, SHAPE.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    changed = idx.clone()
    changed[:, 9] = (idx[:, 9] + 1) % SHAPE.vocab_size
    for causal in (True, False):
        m = model(attention, position, causal)
        with torch.no_grad():
            moved = (m(changed) - m(idx))[:, :9].abs().amax(dim=(0, 2))  # (9,) positions before the change
        if causal:
            assert moved.max().item() < 1e-6
        else:
            assert (moved > 1e-5).all(), moved  # every earlier position saw the change


def test_the_switch_reaches_every_mixer_and_decoding_is_refused():
    bidirectional = model("mha", "learned", causal=False)
    seen = []
    for block in bidirectional.blocks:
        block.attn.register_forward_pre_hook(lambda module, args: seen.append(args[1].causal))
    bidirectional(torch.zeros(1, 4, dtype=torch.long))
    assert seen == [False, False]
    with pytest.raises(ValueError, match="bidirectional"):
        bidirectional.new_cache(1, 8)


class _MLM(Objective):
    name = "mlm"
    causal = False
    special_tokens = ("mask",)


def _model(vocab_size=None) -> ModelOptions:
    return ModelOptions(n_layers=2, d_model=32, n_heads=4, block_size=16, vocab_size=vocab_size)


class _Tokenizer:
    vocab_size, eos_id = 40, None

    def __init__(self, own=None):
        self.own = own or {}

    def special_id(self, name):
        return self.own.get(name)


def test_a_bidirectional_objective_with_a_causal_only_mixer_is_refused_naming_attention_use():
    plugins = {"attention": discovery.load("attention", "mamba")(), "position": discovery.load("position", "none")(),
               "ffn": discovery.load("ffn", "mlp")(), "objective": _MLM()}
    with pytest.raises(UserError) as info:
        build_model(_model(), SHAPE, plugins)
    assert info.value.key == "attention.use" and "mamba" in str(info.value)
    plugins["attention"] = discovery.load("attention", "mha")()
    assert build_model(_model(), SHAPE, plugins).causal is False


def test_mask_ids_are_reserved_past_the_tokenizer_and_grow_the_vocabulary():
    shape, vocab = vocabulary(_model(), _MLM(), _Tokenizer())
    assert vocab.special == {"mask": 40} and vocab.tokenizer_size == 40 and shape.vocab_size == vocab.size == 41
    shape, vocab = vocabulary(_model(), _MLM(), _Tokenizer(own={"mask": 3}))  # the tokenizer's own
    assert vocab.special == {"mask": 3} and shape.vocab_size == 40
    shape, vocab = vocabulary(_model(vocab_size=64), _MLM(), _Tokenizer())  # padded: room already
    assert vocab.special == {"mask": 40} and shape.vocab_size == 64
    with pytest.raises(UserError) as info:
        vocabulary(_model(vocab_size=40), _MLM(), _Tokenizer())
    assert info.value.key == "model.vocab_size" and "special token" in str(info.value)
    shape, vocab = vocabulary(_model(), Objective(), _Tokenizer())  # causal-lm: nothing reserved
    assert vocab.special == {} and shape.vocab_size == 40


class _IgnoresTheSwitch(ReferenceAttentionModule):
    def forward(self, x, ctx, state=None):
        return super().forward(x, MixerContext(ctx.position, ctx.positions, ctx.start, causal=True), state)


class _AntiCausal(ReferenceAttentionModule):
    """Declares bidirectional attention but masks the past instead of nothing: later tokens change earlier
    outputs, yet the mixer is not bidirectional."""

    def forward(self, x, ctx, state=None):
        if ctx.causal:
            return super().forward(x, ctx, state)
        return super().forward(x.flip(1), MixerContext(ctx.position, ctx.positions, ctx.start), state).flip(1)


def _plugin(module_type, declares=True):
    class Broken(Attention):
        name = "broken"
        bidirectional = declares

        def build(self, shape, layer):
            return module_type(shape, shape.n_heads)

    return Broken


@pytest.mark.parametrize("module_type, what", [(_IgnoresTheSwitch, "did not change"),
                                               (_AntiCausal, "permuting the tokens")])
def test_the_kit_fails_a_plugin_that_declares_bidirectional_attention_but_is_not(module_type, what):
    (check,) = [c for c in iter_checks(_plugin(module_type)) if c.name == "bidirectional"]
    with pytest.raises(ConformanceError, match=f"broken: bidirectional: .*{what}"):
        check()


def test_the_kit_passes_honest_plugins_and_those_that_do_not_declare_it():
    check_attention(ReferenceAttention, skip=["compile"])
    (check,) = [c for c in iter_checks(_plugin(_IgnoresTheSwitch, declares=False)) if c.name == "bidirectional"]
    check()  # causal only, and says so: nothing to check
