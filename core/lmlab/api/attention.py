"""The attention slot: the token mixer of each block (softmax attention or a state-space mixer).

Mixers are causal unless asked otherwise: ``MixerContext.causal`` is False only in a model built for
an objective that is not (``Objective.causal = False``, masked language modelling), and the core
builds such a model only with an attention plugin that declares ``bidirectional = True`` (API 1.4).
"""

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from lmlab.api.plugin import Plugin
from lmlab.api.position import PositionModule
from lmlab.api.shape import ModelShape


@dataclass
class MixerContext:
    """What every layer of one forward pass shares: built once per forward by the model, and passed
    to every [AttentionModule][lmlab.api.attention.AttentionModule]."""

    position: PositionModule
    """The model's position module: rotate queries and keys with
    [rotate][lmlab.api.position.PositionModule.rotate] and add
    [attention_bias][lmlab.api.position.PositionModule.attention_bias] to the scores (each a no-op
    for schemes that do not act there; see its flags)."""
    positions: torch.Tensor
    """(T,) int64 absolute positions of the T input tokens, on the input's device:
    ``start, ..., start + T - 1``. In ragged decoding (``key_mask`` set, API 1.8) (B, T): each row
    continues its own sequence, ``positions[b] = starts[b], ..., starts[b] + T - 1``. A new tensor
    object every forward pass, shared by its layers, so a position module may keep what it computes
    from it for the pass's other layers (rope's angles)."""
    start: int = 0
    """How many tokens the inference cache already holds (0 in training and evaluation, where there
    is no cache). In ragged decoding rows hold different numbers; pass it on to the state's
    ``update`` unchanged (the core's state knows where each row writes)."""
    causal: bool = True
    """True: output t sees inputs ≤ t only. False: every output sees every input (no mask at all;
    a position scheme's ``attention_bias`` still applies, for keys on both sides), in a model built
    for a bidirectional objective (API 1.4). It is fixed for a model when it is built, so a module
    may branch on it without a cost per step."""
    key_mask: torch.Tensor | None = None
    """None, except in ragged decoding (API 1.8): (B, 1, T, S) bool, True where query t of row b may
    attend key slot s of the (B, n_kv_heads, S, head_dim) keys the state's ``update`` returned. It
    already holds causality and each row's length, so a module uses it instead of its own causal
    mask (adding a position bias where it is True). Slot s holds position s (``positions`` are per
    row, (B, T)), and every row has at least one key it may attend. The core builds it once per
    forward pass and only for modules whose [kv_layout][lmlab.api.attention.AttentionModule.kv_layout]
    is not None, with a position module that declares ``per_row``."""
    memory: torch.Tensor | None = None
    """The encoder's output (B, S, C), in the decoder of an encoder–decoder model (API 1.13): what a
    cross-attention module ([Attention.build_cross][lmlab.api.attention.Attention.build_cross])
    attends to. None elsewhere, and in decoding, where the core hands a cross-attention module its
    keys and values, computed once per prompt, as its ``state``."""
    memory_padding: torch.Tensor | None = None
    """(B, S) bool, True on the encoder's padding positions, which no query may attend (API 1.13);
    None: no padding."""


class AttentionModule(nn.Module):
    """The token mixer of one block: ``forward(x (B, T, C), ctx, state) → (B, T, C)``. Causal when
    ``ctx.causal`` (output t sees inputs ≤ t only); when the plugin declares
    [Attention.bidirectional][lmlab.api.attention.Attention.bidirectional], with ``ctx.causal`` False
    every output sees every input.

    The block calls it on its normalised input and adds the result to the residual stream (after
    dropout). Parameter and buffer names are part of the checkpoint format.
    """

    def forward(self, x: torch.Tensor, ctx: MixerContext, state=None) -> torch.Tensor:
        """Mix information across the T positions of ``x``.

        Called for every block in every forward pass: in training (``self.training`` True,
        gradients on, under the precision's autocast; again during backward when
        ``train.checkpointing`` recomputes the block), in evaluation (eval mode, no gradients) and
        in decoding (eval mode, ``torch.no_grad()``, with ``state``).

        Args:
            x: (B, T, C) hidden states, C = ``shape.d_model``, on the parameters' device. Under a
                ``*-mixed`` precision the pass runs inside ``torch.autocast``, so dtypes follow its
                rules (the norm before the module may hand it float32); otherwise the parameters'
                dtype.
            ctx: Positions, the position module and whether to mask, shared by every layer.
            state: None without a cache (training, evaluation); in decoding, this layer's state from
                [new_state][lmlab.api.attention.AttentionModule.new_state]: ``x`` then continues
                the ``ctx.start`` tokens the state already holds, and the module adds the new
                tokens to it and attends over all of them.

        Returns:
            The mixed hidden states, (B, T, C), for the residual add.
        """
        raise NotImplementedError

    def new_state(self, batch_size: int, max_len: int, device, dtype):
        """Fresh inference state for decoding up to ``max_len`` tokens (see
        [lmlab.api.cache][lmlab.api.cache]).

        Called by the model's ``new_cache``, once per layer per generation (and again when a
        [Stepper][lmlab.api.decoding.Stepper] slides its window).

        Args:
            batch_size: Rows decoded together (B).
            max_len: Positions the state must hold, at most the model's ``max_context``.
            device: The model's device.
            dtype: The model's parameter dtype.

        Returns:
            An object with ``reorder(index)`` ([LayerState][lmlab.api.cache.LayerState]), e.g. a
            [KVCache][lmlab.api.cache.KVCache].
        """
        raise NotImplementedError

    def kv_layout(self) -> tuple[int, int] | None:
        """``(n_kv_heads, head_dim)`` when this module's decoding state is a plain key/value cache (API 1.8).

        Then the core may hold the keys and values itself, in a cache shared by sequences of
        different lengths (a contiguous one, or a paged one of fixed-size blocks), for batched
        generation of prompts of different lengths and for ``lmlab serve``'s continuous batching. In
        that mode ``forward`` receives as ``state`` an object with [KVCache][lmlab.api.cache.KVCache]'s
        ``update(k, v, start)`` (it returns every row's keys and values, (B, n_kv_heads, S,
        head_dim)), ``ctx.positions`` is (B, T) and ``ctx.key_mask`` says which of the S keys each
        query may attend. A module that returns a layout promises to honour both (the conformance
        kit's ``ragged_decoding`` check). Default None: the core decodes such a model one sequence at
        a time through [new_state][lmlab.api.attention.AttentionModule.new_state] (recurrent mixers).
        """
        return None

    def reset_parameters(self, shape: ModelShape) -> None:
        """Initialise weights; output projections into the residual use ``shape.residual_init_std``.

        Called once when the model is built, right after every module is made, before any starting
        weights are loaded; the model calls it, so ``__init__`` need not initialise again. Draw from
        the global random generator (seeded by the run's seed). Default: nothing.
        """

    def tensor_parallel_plan(self, tp_size: int) -> dict | None:
        """How to split this module over ``tp_size`` tensor-parallel ranks (API 1.3): a plan for
        ``torch.distributed.tensor.parallel.parallelize_module(self, tp_mesh, plan)``, mapping
        submodule names to ``ParallelStyle`` objects, in the manner of Megatron-LM (Shoeybi et al.
        2019): query/key/value projections column-wise and the output projection row-wise, so each
        rank computes ``n_heads / tp_size`` whole heads and one all-reduce sums the partial outputs.

        The parallel plugin calls this when the model is built (to refuse a bad layout before any
        process starts), and again in every process before it applies the plan. Calling it changes
        nothing; applying the plan must leave the module computing with its local share (its heads,
        its slice of an ``attention_bias``), taking and returning replicated ``(B, T, C)`` tensors.
        Parameter names must not change: checkpoints hold the gathered full weights under the
        single-device names (a fused projection whose sharding is not a plain split of its rows
        restores that layout in its state dict, for saving and loading). Raise ``ValueError``
        saying why when the module cannot be split ``tp_size`` ways (heads not divisible); the
        default, None, means the module does not support tensor parallelism.
        """
        return None

    def peft_roles(self) -> dict[str, str]:
        """Which submodules play which role for PEFT methods (API 1.4): role → submodule name, e.g.
        ``{"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "out_proj"}`` for softmax attention
        (queries, keys, values, output projection); a mixer without those names its own (Mamba:
        ``in``, ``x``, ``o``). Manifests name roles (``[peft] targets = ["q", "v"]``), so one
        manifest adapts the same layers whichever attention plugin built them. The submodules are
        usually ``nn.Linear``; a PEFT method may replace them with wrappers, so the forward pass must
        only call them. The default, empty, offers nothing to adapt by role."""
        return {}

    def head_groups(self) -> tuple[int, int] | None:
        """(query heads, key/value heads) of this module, for structured head pruning (API 1.9); query
        head h reads key/value head ``h // (query heads / key/value heads)``, and the ``o`` role's
        input holds head h's output at features ``[h·head_dim, (h+1)·head_dim)``. None (the default):
        the module has no heads to prune."""
        return None

    def prune_heads(self, keep: list[int]) -> None:
        """Keep only query heads ``keep`` (ascending indices), physically shrinking the projections
        (API 1.9). A key/value head whose query heads all go is removed with them; the caller keeps
        every remaining key/value head's group the same size. Called by ``head-prune`` and again, with
        the same list, when a pruned run is loaded; the module must then run as if built with
        ``len(keep)`` heads."""
        raise NotImplementedError(f"{type(self).__name__} cannot prune heads")


class CrossAttentionModule(AttentionModule):
    """Attention from a decoder block's tokens to the encoder's output (API 1.13):
    ``forward(x (B, T, C), ctx, state) → (B, T, C)``, queries from ``x``, keys and values from
    ``ctx.memory`` (B, S, C), never attending where ``ctx.memory_padding`` is True. Every query sees
    every unpadded encoder position, and nothing of the decoder: causality is the self-attention's
    business. No position scheme applies (as in T5 and BART).

    In decoding the core calls [memory_kv][lmlab.api.attention.CrossAttentionModule.memory_kv] once
    per prompt, keeps its keys and values with the row, and passes the rows' ``(keys, values)`` as
    ``state`` (``ctx.memory`` is then None); ``forward`` must attend over those instead of projecting
    again.
    """

    def memory_kv(self, memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the encoder's output (B, S, C): two (B, n_kv_heads, S, head_dim) tensors."""
        raise NotImplementedError


class Attention(Plugin):
    """The token mixer of each block: [build][lmlab.api.attention.Attention.build] makes one
    [AttentionModule][lmlab.api.attention.AttentionModule] per layer, causal, and bidirectional too
    when the plugin declares [bidirectional][lmlab.api.attention.Attention.bidirectional]."""

    slot = "attention"
    bidirectional: ClassVar[bool] = False
    """Whether the modules honour ``MixerContext.causal = False`` (API 1.4). A model for a
    bidirectional objective (``mlm``) is built only with a plugin that says True;
    ``lmlab.testing.check_attention`` then checks that every output really sees every input. A
    recurrent mixer stays False."""
    cross_attention: ClassVar[bool] = False
    """Whether [build_cross][lmlab.api.attention.Attention.build_cross] makes cross-attention modules
    (API 1.13). An encoder–decoder model (``[architecture] use = "encoder-decoder"``) is built only
    with a plugin that says True (and ``bidirectional``, for its encoder)."""

    def build_cross(self, shape: ModelShape, layer: int) -> CrossAttentionModule:
        """Make the cross-attention of decoder block ``layer`` (API 1.13), when
        [cross_attention][lmlab.api.attention.Attention.cross_attention] is True; called like
        [build][lmlab.api.attention.Attention.build], with the decoder's shape."""
        raise NotImplementedError(f"{type(self).__name__} has no cross-attention")

    def build(self, shape: ModelShape, layer: int) -> AttentionModule:
        """Make the mixer of block ``layer``.

        Called once per block whenever a model is built: for a run, for ``lmlab check`` (on the
        meta device: allocate nothing, read no data) and ``lmlab plan`` (on fake tensors), and when
        ``generate``, ``eval`` or ``merge`` load a trained run. Raise a UserError naming the option
        for a setting that does not fit the shape (heads that do not divide ``d_model``).

        Args:
            shape: The model's shape.
            layer: The block's index, 0 to ``shape.n_layers - 1``.

        Returns:
            A new module (never one shared between blocks).
        """
        raise NotImplementedError
