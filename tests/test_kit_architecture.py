"""The conformance kit's architecture checks: a correct architecture passes, and architectures broken in
one specific way each fail the check for it, with a message that says what to fix. (The first-party
architectures are checked in plugins/lmlab-architectures/tests.)"""

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lmlab.api import Architecture, ModelParts
from lmlab.api.architecture import Block, Stack
from lmlab.testing import ConformanceError, check_architecture, check_names, check_plugin, iter_checks


class Plain(Architecture):
    """The pre-norm decoder/encoder, built as the contract asks: correct."""

    name = "plain"
    api = ">=1.18,<2"
    block: type = Block
    causal_always = False

    def build(self, parts: ModelParts):
        return Stack(parts.shape, position=parts.position, attention=parts.attention, ffn=parts.ffn,
                     norm=parts.norm, causal=self.causal_always or parts.family == "decoder", block=self.block)


class PeekingBlock(Block):
    """Adds a little of the next position's hidden state: sees the future."""

    def forward(self, x, ctx, state=None):
        x = super().forward(x, ctx, state)
        return x + 0.5 * torch.roll(x, -1, dims=1)


class HiddenFFNBlock(Block):
    """Keeps its ffn out of the module tree (in a list): neither block.ffn nor its aux_loss is found."""

    def __init__(self, *args):
        super().__init__(*args)
        self._hidden = [self.ffn]
        del self.ffn

    def reset_parameters(self, shape):
        self.attn.reset_parameters(shape)

    def forward(self, x, ctx, state=None):
        x = x + self.attn(self.norm1(x), ctx, state)
        return x + self._hidden[0](self.norm2(x))


class SkipsFFNWhenFullBlock(Block):
    """Under "full" checkpointing, recomputes the block without its ffn: the loss changes."""

    def forward(self, x, ctx, state=None):
        if self.checkpointing == "full" and self.training:
            return checkpoint(lambda h: h + self.attn(self.norm1(h), ctx, state), x, use_reentrant=False)
        return super().forward(x, ctx, state)


class NeverCheckpointsBlock(Block):
    """Ignores self.checkpointing: keeps every activation whatever the policy."""

    def forward(self, x, ctx, state=None):
        x = x + self.attn(self.norm1(x), ctx, state)
        return x + self.ffn(self.norm2(x))


def wired(block: type, name: str, **attributes) -> type:
    return type(name, (Plain,), {"name": name, "block": block, **attributes})


def failures(plugin) -> dict[str, str]:
    """check name → message, for every check the plugin fails."""
    found = {}
    for check in iter_checks(plugin):
        try:
            check()
        except ConformanceError as exc:
            found[check.name] = str(exc)
    return found


def test_a_correct_architecture_passes_every_check_by_every_entry_point():
    check_architecture(Plain)
    check_plugin(Plain)
    assert check_names("architecture")[:2] == ["plugin_class", "families"]
    assert {"causality", "incremental_decoding", "checkpointing", "param_infos", "aux_loss",
            "block_contract"} <= set(check_names("architecture"))


def test_a_block_that_peeks_at_later_tokens_fails_causality_and_decoding():
    found = failures(wired(PeekingBlock, "peeking"))
    assert "the decoder model: the logits up to position 0 changed when only the tokens after 0 did" \
        in found["causality"], found
    assert "does a block mix positions outside its mixer" in found["causality"]
    assert "differ from the full forward's" in found["incremental_decoding"], found


def test_an_encoder_built_causal_fails_causality():
    found = failures(wired(Block, "causal-encoder", causal_always=True))
    assert sorted(found) == ["causality", "language_model"], found
    assert "new_cache gave a cache for a bidirectional model" in found["language_model"]
    assert "the encoder model: changing the last token moved the earlier positions' logits by only" \
        in found["causality"]
    assert "build it with causal=False" in found["causality"]


def test_an_ffn_outside_the_module_tree_loses_its_aux_loss_and_breaks_the_block_contract():
    found = failures(wired(HiddenFFNBlock, "hidden-ffn"))
    assert "model.aux_loss() is None after a forward in which 2 ffn modules set aux_loss" in found["aux_loss"], found
    assert "block 0 has no ffn, its feed-forward as an lmlab.api.FFNModule" in found["block_contract"], found
    with pytest.raises(ConformanceError, match="hidden-ffn: aux_loss: the decoder model: model.aux_loss"):
        check_architecture(wired(HiddenFFNBlock, "hidden-ffn"))


def test_a_checkpointing_that_changes_the_loss_is_caught():
    found = failures(wired(SkipsFFNWhenFullBlock, "skips-ffn"))
    assert list(found) == ["checkpointing"], found
    assert "with set_checkpointing('full') the training loss is" in found["checkpointing"]
    assert "a checkpointed part must compute what the plain forward computes" in found["checkpointing"]


def test_a_block_that_ignores_checkpointing_is_caught():
    found = failures(wired(NeverCheckpointsBlock, "never-checkpoints"))
    assert list(found) == ["checkpointing"], found
    assert "the blocks' forward ignores self.checkpointing" in found["checkpointing"]


def test_param_infos_that_leave_out_a_parameter_are_caught():
    class Frozen(Plain):
        name = "forgets-norm"

        def build(self, parts):
            model = super().build(parts)
            model.param_infos = lambda: [i for i in Stack.param_infos(model) if not i.name.startswith("norm_f.")]
            return model

    found = failures(Frozen)
    assert list(found) == ["param_infos"], found
    assert "param_infos() leaves out the trainable parameters norm_f.weight" in found["param_infos"]


def test_a_build_that_returns_no_module_is_named():
    class NotAModel(Plain):
        name = "not-a-model"

        def build(self, parts):
            return nn.Linear(1, 1).weight

    found = failures(NotAModel)
    assert "build(parts) returned Parameter, not an nn.Module" in found["language_model"], found
