"""``[architecture] use = "parallel-block"``: GPT-J / PaLM's parallel formulation, x + mixer(norm x) +
ffn(norm x) from one norm (Wang & Komatsuzaki 2021; Chowdhery et al. 2022, section 2): the two
branches read the same input, so their matrix multiplies can run together, at a small quality cost at
small scale. Everything else (layer patterns, exit heads, caches) is the decoder's.
"""

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lmlab.api import ModelShape
from lmlab.api.architecture import Block

from lmlab_architectures.decoder import Decoder


class ParallelBlock(Block):
    """x + dropout(mixer(norm x)) + dropout(ffn(norm x)), one norm; ``checkpointing = "ffn"`` recomputes
    the ffn branch, ``"attention"`` the mixer's, ``"full"`` the whole block."""

    def __init__(self, shape: ModelShape, norm: str, norm_eps: float, attention, ffn, layer: int):
        super().__init__(shape, norm, norm_eps, attention, ffn, layer)
        self.norm2 = nn.Identity()  # one norm feeds both branches

    def reset_parameters(self, shape: ModelShape) -> None:
        self.attn.reset_parameters(shape)
        self.ffn.reset_parameters(shape)
        self.norm1.reset_parameters()

    def forward(self, x, ctx, state=None):
        policy = self.checkpointing if self.training and torch.is_grad_enabled() else "none"
        if policy == "full":
            return checkpoint(self._both, x, ctx, state, use_reentrant=False)
        h = self.norm1(x)
        mixed = checkpoint(self._mixer, h, ctx, state, use_reentrant=False) if policy == "attention" \
            else self._mixer(h, ctx, state)
        if not self.has_ffn:
            return x + mixed
        fed = checkpoint(self._ffn, h, use_reentrant=False) if policy == "ffn" else self._ffn(h)
        return x + mixed + fed

    def _both(self, x, ctx, state):
        h = self.norm1(x)
        out = x + self._mixer(h, ctx, state)
        return out + self._ffn(h) if self.has_ffn else out

    def _mixer(self, h, ctx, state):
        return self.dropout(self.attn(h, ctx, state))

    def _ffn(self, h):
        return self.dropout(self.ffn(h))


class ParallelDecoder(Decoder):
    """Decoder-only transformer with parallel blocks (GPT-J, PaLM): x + mixer(norm x) + ffn(norm x)."""

    block = ParallelBlock
    hf_model_types = {}  # Llama's and GPT-2's blocks are sequential: `decoder` reads them
    hf_readers = {}
