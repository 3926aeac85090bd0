"""``[architecture] use = "parallel-block"``: GPT-J / PaLM's parallel formulation, x + mixer(norm x) +
ffn(norm x) from one norm (Wang & Komatsuzaki 2021; Chowdhery et al. 2022, section 2): the two
branches read the same input, so their matrix multiplies can run together, at a small quality cost at
small scale. ``shared_norm = false`` gives each branch its own norm, x + mixer(norm1 x) + ffn(norm2 x),
as GPT-NeoX and Pythia do (Black et al. 2022), whose Hugging Face checkpoints it reads
(:mod:`lmlab_architectures.hf_neox`). Everything else (layer patterns, exit heads, caches) is the
decoder's.
"""

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lmlab.api import Field, ModelShape
from lmlab.api.architecture import Block

from lmlab_architectures import hf_neox
from lmlab_architectures.decoder import Decoder, DecoderOptions


class ParallelBlock(Block):
    """x + dropout(mixer(norm x)) + dropout(ffn(norm x)), one norm; ``checkpointing = "ffn"`` recomputes
    the ffn branch, ``"attention"`` the mixer's, ``"full"`` the whole block."""

    shared_norm = True  # one norm feeds both branches; False: the ffn's has its own (norm2)

    def __init__(self, shape: ModelShape, norm: str, norm_eps: float, attention, ffn, layer: int):
        super().__init__(shape, norm, norm_eps, attention, ffn, layer)
        if self.shared_norm:
            self.norm2 = nn.Identity()

    def reset_parameters(self, shape: ModelShape) -> None:
        self.attn.reset_parameters(shape)
        self.ffn.reset_parameters(shape)
        self.norm1.reset_parameters()
        if not self.shared_norm:
            self.norm2.reset_parameters()

    def forward(self, x, ctx, state=None):
        policy = self.checkpointing if self.training and torch.is_grad_enabled() else "none"
        if policy == "full":
            return checkpoint(self._both, x, ctx, state, use_reentrant=False)
        h = self.norm1(x)
        mixed = checkpoint(self._mixer, h, ctx, state, use_reentrant=False) if policy == "attention" \
            else self._mixer(h, ctx, state)
        if not self.has_ffn:
            return x + mixed
        g = self._ffn_input(x, h)
        fed = checkpoint(self._ffn, g, use_reentrant=False) if policy == "ffn" else self._ffn(g)
        return x + mixed + fed

    def _both(self, x, ctx, state):
        h = self.norm1(x)
        out = x + self._mixer(h, ctx, state)
        return out + self._ffn(self._ffn_input(x, h)) if self.has_ffn else out

    def _ffn_input(self, x, h):
        return h if self.shared_norm else self.norm2(x)

    def _mixer(self, h, ctx, state):
        return self.dropout(self.attn(h, ctx, state))

    def _ffn(self, h):
        return self.dropout(self.ffn(h))


class TwoNormBlock(ParallelBlock):
    """x + mixer(norm1 x) + ffn(norm2 x): GPT-NeoX's parallel residual."""

    shared_norm = False


class ParallelOptions(DecoderOptions):
    shared_norm: bool = Field(True, help="one norm feeds both branches (GPT-J, PaLM); false: each has its own, "
                                         "x + mixer(norm1 x) + ffn(norm2 x) (GPT-NeoX, Pythia)")


class ParallelDecoder(Decoder):
    """Decoder-only transformer with parallel blocks (GPT-J, PaLM): x + mixer(norm x) + ffn(norm x)."""

    Options = ParallelOptions
    hf_model_types = {hf_neox.MODEL_TYPE: "GPT-NeoX"}  # Llama's and GPT-2's blocks are sequential: `decoder`'s
    hf_readers = {hf_neox.MODEL_TYPE: hf_neox}

    @property
    def block(self) -> type:
        return ParallelBlock if self.options.shared_norm else TwoNormBlock
