"""The pre-norm residual block both model families stack (``lmlab.api.architecture.Block``), and how
their parameters are counted and offered to the optimizer."""

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lmlab.api import MixerContext, ModelShape, ParamInfo
from lmlab.norms import build_norm


class Block(nn.Module):
    """Pre-norm residual block: x + mixer(norm(x)), then x + ffn(norm(x)).

    Activation checkpointing recomputes a part's activations during backward instead of keeping
    them: ``full`` the whole block, ``attention`` or ``ffn`` only that part (e.g. the ffn holds the
    widest activations, 4·d per token, but is cheap to recompute).

    Another wiring subclasses it (see ``lmlab.api.architecture``): the mixer stays ``attn`` and the
    ffn ``ffn``, which is what tensor parallelism, FSDP, PEFT roles and decoding caches look for.
    """

    def __init__(self, shape: ModelShape, norm: str, norm_eps: float, attention, ffn, layer: int):
        super().__init__()
        self.norm1 = build_norm(norm, shape, norm_eps)
        self.attn = attention.build(shape, layer)
        self.ffn = ffn.build(shape, layer)
        # A skipped ffn (FFNModule.skip) leaves a mixer-only block: no norm, no residual branch.
        self.has_ffn = not getattr(self.ffn, "skip", False)
        self.norm2 = build_norm(norm, shape, norm_eps) if self.has_ffn else nn.Identity()
        # Identity rather than Dropout(0): a dropout call with p = 0 still costs a kernel per use.
        self.dropout = nn.Dropout(shape.dropout) if shape.dropout else nn.Identity()
        self.checkpointing = "none"

    def forward(self, x: torch.Tensor, ctx: MixerContext, state=None) -> torch.Tensor:
        policy = self.checkpointing if self.training and torch.is_grad_enabled() else "none"
        if policy == "full":
            return checkpoint(self._forward, x, ctx, state, use_reentrant=False)
        if policy == "attention":
            x = x + checkpoint(self._mix, x, ctx, state, use_reentrant=False)
        else:
            x = x + self._mix(x, ctx, state)
        if not self.has_ffn:
            return x
        if policy == "ffn":
            return x + checkpoint(self._feed_forward, x, use_reentrant=False)
        return x + self._feed_forward(x)

    def reset_parameters(self, shape: ModelShape) -> None:
        """Each part initialises its own weights (the plugins' modules, then the norms)."""
        self.attn.reset_parameters(shape)
        self.ffn.reset_parameters(shape)
        self.norm1.reset_parameters()
        if self.has_ffn:
            self.norm2.reset_parameters()

    def new_state(self, batch_size: int, max_len: int, device, dtype):
        """The decoding state of the block's mixer (its KV cache, a recurrent state)."""
        return self.attn.new_state(batch_size, max_len, device, dtype)

    def _forward(self, x, ctx, state):
        x = x + self._mix(x, ctx, state)
        return x + self._feed_forward(x) if self.has_ffn else x

    def _mix(self, x, ctx, state):
        return self.dropout(self.attn(self.norm1(x), ctx, state))

    def _feed_forward(self, x):
        return self.dropout(self.ffn(self.norm2(x)))


def param_infos(model: nn.Module) -> list[ParamInfo]:
    """Trainable parameters; weight decay only for matrices that are not embeddings, and never for a
    parameter a plugin marked ``_no_weight_decay = True`` (Mamba's A_log and D)."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return [ParamInfo(name, p, decay=p.dim() >= 2 and id(p) not in embeddings
                      and not getattr(p, "_no_weight_decay", False))
            for name, p in model.named_parameters() if p.requires_grad]


def num_params(model: nn.Module, trainable_only: bool = False) -> int:
    return sum(_logical_numel(p) for p in model.parameters() if p.requires_grad or not trainable_only)


def _logical_numel(p: torch.Tensor) -> int:
    # A 4-bit quantised weight (bitsandbytes' Params4bit, under the qlora peft plugin) is stored as
    # packed bytes, two weights each; count the weights it stands for, with the shape it records.
    shape = getattr(getattr(p, "quant_state", None), "shape", None)
    return int(torch.Size(shape).numel()) if shape is not None else p.numel()
