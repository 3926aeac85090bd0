"""The decoder-only transformer stack (``lmlab.api.architecture.Stack``), which architecture plugins
wire from the position, attention and ffn plugins, and the model a variant's architecture builds.

Every plugin is asked for its module once, here, when the model is built; the forward pass only
calls modules, so swapping a plugin costs nothing per step.
"""

import dataclasses
from typing import NamedTuple

import torch
from torch import nn

from lmlab.api import InferenceCache, MixerContext, ModelShape, ParamInfo
from lmlab.api.architecture import DECODER, ENCODER, ENCODER_DECODER, FAMILIES, ModelParts
from lmlab.block import Block, num_params, param_infos
from lmlab.config import CHECKPOINTING
from lmlab.errors import UserError
from lmlab.norms import build_norm
from lmlab.variant import components_of


class _Dropped(nn.Module):
    """Holds the place of a block another pipeline stage runs, so later blocks keep their names."""


class LanguageModel(nn.Module):
    """Token embedding → position → blocks → final norm → (tied) head; see ``lmlab.api.LanguageModel``."""

    #: Names of the extra prediction heads the objective scores beside the output head (API 1.19; a
    #: subclass's, e.g. early exit's heads): ``forward(idx, extras=True)`` returns their logits too,
    #: the training loss adds ``extra_loss_weight`` times their mean loss, and each one's validation
    #: loss is reported in ``summary.json`` as ``val_<extra_losses_name>``.
    extra_heads: tuple[str, ...] = ()
    extra_loss_weight: float = 1.0
    extra_losses_name: str = "extra_losses"

    def __init__(self, shape: ModelShape, *, position, attention, ffn, norm: str = "layernorm",
                 norm_eps: float = 1e-5, tie_embeddings: bool = True, causal: bool = True,
                 heads=None, block: type[nn.Module] = Block):
        """``attention``: the mixer plugin of every layer, or a sequence of ``n_layers`` of them (a
        layer pattern); ``block``: the block class, called as ``block(shape, norm, norm_eps, mixer,
        ffn, layer)`` (see ``lmlab.api.architecture``)."""
        super().__init__()
        mixers = list(attention) if isinstance(attention, (list, tuple)) else [attention] * shape.n_layers
        if len(mixers) != shape.n_layers:
            raise ValueError(f"{len(mixers)} mixers for {shape.n_layers} layers")
        self.shape = shape
        # False for a bidirectional objective (masked LM): every mixer sees the whole window. The
        # caller (lmlab.assemble) has checked that the attention plugin supports it.
        self.causal = causal
        self.block_size = shape.block_size
        self.vocab_size = shape.vocab_size
        self.tok_emb = nn.Embedding(shape.vocab_size, shape.d_model)
        self.position = position.build(shape)
        self.dropout = nn.Dropout(shape.dropout) if shape.dropout else nn.Identity()
        self.blocks = nn.ModuleList(block(shape, norm, norm_eps, mixers[i], ffn, i) for i in range(shape.n_layers))
        self.norm_f = build_norm(norm, shape, norm_eps)
        self.head = nn.Linear(shape.d_model, shape.vocab_size, bias=False)
        self.span = (0, shape.n_layers)  # the blocks this model runs: all, or a pipeline stage's
        if tie_embeddings:
            # Weight tying (Press & Wolf 2017): one matrix embeds tokens and scores them.
            self.head.weight = self.tok_emb.weight
        self.norm_name, self.norm_eps = norm, norm_eps  # for a subclass's added norms (build_norm)
        self.add_modules()
        self.reset_parameters()
        # The objective's own modules (Objective.heads: a reward model's scalar head, PPO's value head),
        # initialised by the objective; None without any, so other models' state dicts are unchanged.
        self.heads = nn.ModuleDict(dict(heads)) if heads else None

    def add_modules(self) -> None:
        """A subclass's own modules, added before the weights are initialised (they are then in
        ``reset_parameters``' care). Default: none."""

    def extra_logits(self, layer: int, x: torch.Tensor) -> torch.Tensor | None:
        """The logits (B, T, V) of the extra head that reads block ``layer``'s output ``x``, or None
        when none does; called during ``forward(extras=True)`` after every block, in order."""
        return None

    def init_missing(self, state: dict, missing: list[str]) -> list[str]:
        """Start weights that an ``[init]`` checkpoint lacks (a subclass's added heads) from ``state``,
        the init's weights as they will load, by adding entries to it; return the names still missing.
        Default: none is started."""
        return missing

    def reset_parameters(self) -> None:
        """GPT-2 init: N(0, init_std) embeddings; each plugin module initialises its own weights."""
        std = self.shape.init_std
        nn.init.normal_(self.tok_emb.weight, 0.0, std)
        if self.head.weight is not self.tok_emb.weight:
            nn.init.normal_(self.head.weight, 0.0, std)
        self.position.reset_parameters(self.shape)
        for block in self.blocks:
            block.reset_parameters(self.shape)
        self.norm_f.reset_parameters()
        for head in getattr(self, "heads", None).values() if getattr(self, "heads", None) is not None else ():
            if hasattr(head, "reset_parameters"):  # the objective's own initialisation, again
                head.reset_parameters()

    def set_checkpointing(self, policy: str) -> None:
        """Activation checkpointing for every block: one of CHECKPOINTING."""
        if policy not in CHECKPOINTING:
            raise ValueError(f"checkpointing must be one of {CHECKPOINTING}, got {policy!r}")
        for block in self.blocks:
            block.checkpointing = policy

    @property
    def max_context(self) -> int | None:
        return self.position.max_positions

    def pipeline_stage(self, start: int, stop: int) -> None:
        """Keep only what blocks [start, stop) need; see ``lmlab.api.LanguageModel.pipeline_stage``."""
        n = len(self.blocks)
        if not 0 <= start < stop <= n or self.span != (0, n):
            raise ValueError(f"a pipeline stage is a non-empty span of blocks 0..{n - 1} of a whole model; "
                             f"got [{start}, {stop}) of a model running {list(self.span)}")
        if self.extra_heads:  # an extra head's loss needs the output head, which only the last stage holds
            raise UserError("extra prediction heads cannot be trained under pipeline parallelism (each needs the "
                            "output head, which only the last stage holds)", key="parallel.use")
        tied = self.head.weight is self.tok_emb.weight
        for i in range(n):
            if not start <= i < stop:
                self.blocks[i] = _Dropped()
        if start > 0 and not (stop == n and tied):
            self.tok_emb = None
        if stop < n:
            self.norm_f = self.head = None
        self.span = (start, stop)

    def forward(self, idx: torch.Tensor, cache: InferenceCache | None = None, extras: bool = False,
                hidden: bool = False):
        """idx (B, T) → logits (B, T, V). ``extras``: (logits, [the logits (B, T, V) of each of
        ``extra_heads``, in block order]), what the training loss needs of a model with extra heads.
        ``hidden``: the final norm's output (B, T, C) instead of logits, for an objective's heads."""
        start = cache.length if cache is not None else 0
        T = idx.shape[1]
        positions = getattr(cache, "positions", None)  # the engine's rows: set per forward pass
        if positions is not None:
            ctx = MixerContext(position=self.position, positions=positions, start=start, causal=True,
                               key_mask=cache.key_mask)
        else:
            if self.max_context is not None and start + T > self.max_context:
                raise ValueError(f"positions up to {start + T - 1} requested; this model's position scheme covers "
                                 f"0..{self.max_context - 1} (model.block_size); crop the context")
            positions = torch.arange(start, start + T, device=idx.device)
            ctx = MixerContext(position=self.position, positions=positions, start=start, causal=self.causal)
        first, stop = self.span
        if first == 0:
            x = self.dropout(self.position.embed(self.tok_emb(idx), positions))  # (B, T, C)
        else:
            x = idx  # a later pipeline stage: the previous stage's hidden states (B, T, C)
        states = cache.states if cache is not None else (None,) * len(self.blocks)
        extra = []
        for i in range(first, stop):
            x = self.blocks[i](x, ctx, states[i])
            if extras and (out := self.extra_logits(i, x)) is not None:
                extra.append(out)
        if cache is not None:
            cache.length = start + T
        if stop < len(self.blocks):
            return x
        if hidden:
            return self.norm_f(x)
        logits = self.head(self.norm_f(x))
        return (logits, extra) if extras else logits

    def aux_loss(self) -> torch.Tensor | None:
        """Sum of the auxiliary losses the blocks' modules stored in their last forward (e.g. MoE
        balance), wherever in a block they sit (a pipeline stage holds only its own blocks)."""
        losses = [m.aux_loss for m in self.blocks.modules() if isinstance(getattr(m, "aux_loss", None), torch.Tensor)]
        return torch.stack(losses).sum() if losses else None

    def new_cache(self, batch_size: int, max_len: int) -> InferenceCache:
        if self.max_context is not None and max_len > self.max_context:
            raise ValueError(f"max_len {max_len} exceeds the model's context of {self.max_context}")
        if self.span != (0, len(self.blocks)):
            raise ValueError("a pipeline stage cannot decode: load the checkpoint into a whole model")
        if not self.causal:
            raise ValueError("a bidirectional model (trained with a non-causal objective such as mlm) cannot "
                             "decode left to right")
        p = self.head.weight
        states = [b.new_state(batch_size, max_len, p.device, p.dtype) for b in self.blocks]
        return InferenceCache(states, max_len)

    def param_infos(self) -> list[ParamInfo]:
        """Trainable parameters, with weight decay as :func:`lmlab.block.param_infos` decides."""
        return param_infos(self)

    def num_params(self, trainable_only: bool = False) -> int:
        return num_params(self, trainable_only)


class StepLoss(NamedTuple):
    total: torch.Tensor  # what is minimised: the objective's loss plus auxiliary losses
    loss: torch.Tensor  # the objective's loss alone (reported as train/val loss)
    aux: torch.Tensor | None  # the sum of the auxiliary losses, if any module reported one
    logits: torch.Tensor | None  # None when the objective ran the model itself (Objective.forward_loss)
    extras: torch.Tensor | None = None  # (E,) the objective's loss at each of the model's extra_heads, unweighted


def compute_loss(model: LanguageModel, objective, batch, forward=None) -> StepLoss:
    """One training/eval forward; ``forward`` is the callable to run (e.g. the compiled model).

    A model with extra heads (``extra_heads``) also scores the targets at each; its
    ``extra_loss_weight`` times the mean of those losses joins the auxiliary loss, while ``loss``
    stays the output head's."""
    run = model if forward is None else forward
    if objective.runs_model():
        # The objective runs the (eager) model itself: pairs, heads, rollouts (Objective.forward_loss).
        loss = objective.forward_loss(model, batch)
        aux = model.aux_loss()
        return StepLoss(loss if aux is None else loss + aux, loss, aux, None)
    if not getattr(model, "extra_heads", ()):  # a model of the author's own class may lack the attribute
        logits = run(batch.input_ids, **batch.model_inputs())
        loss = objective.loss(logits, batch)
        aux = model.aux_loss()
        return StepLoss(loss if aux is None else loss + aux, loss, aux, logits)
    logits, extra_logits = run(batch.input_ids, extras=True)
    loss = objective.loss(logits, batch)
    extras = torch.stack([objective.loss(out, batch) for out in extra_logits])
    aux = model.aux_loss()
    weighted = model.extra_loss_weight * extras.mean()
    aux = weighted if aux is None else aux + weighted
    return StepLoss(loss + aux, loss, aux, logits, extras)


def shape_of(model, vocab_size: int) -> ModelShape:
    """The shape ``model`` (``[model]``, a ModelOptions) describes, with ``vocab_size`` ids."""
    return ModelShape(n_layers=model.n_layers, d_model=model.d_model, n_heads=model.n_heads,
                      block_size=model.block_size, vocab_size=vocab_size, dropout=model.dropout, bias=model.bias,
                      init_std=model.init_std, explicit_head_dim=model.head_dim)


def family(architecture, objective) -> str:
    """The model family the variant trains: the first the objective trains (``Objective.trains``) that
    the architecture plugin builds; a UserError naming ``architecture.use`` when it builds none."""
    trains = objective.trains() if objective is not None else FAMILIES
    return architecture.family(trains, objective.name if objective is not None else "none")


def default_plugin(slot: str):
    """An instance of the plugin a manifest that leaves ``slot`` out gets, with its default options."""
    from lmlab import discovery
    from lmlab.slots import DEFAULT_PLUGINS

    return discovery.load(slot, DEFAULT_PLUGINS[slot])()


def mixer_plugins(plugins: dict) -> list:
    """The attention-slot plugins the model's mixers come from: ``[attention]``'s and those the
    architecture's nested tables name (a layer pattern's)."""
    arch = plugins["architecture"]
    nested = components_of(arch)
    return [plugins["attention"], *(p for f, slot in arch.components.items() if slot == "attention"
                                    for p in nested.get(f, {}).values())]


def build_model(model, shape: ModelShape, plugins: dict, decoder_start_id: int | None = None):
    """The model the architecture plugin wires from the position, attention and ffn plugins and the shared
    ``[model]`` settings; bidirectional when the objective is not causal, which needs attention plugins
    that support it (``Attention.bidirectional``); an encoder-decoder needs their cross-attention too."""
    if "architecture" not in plugins:  # a caller that assembles plugins by hand (tests, the kit): the slot's default
        plugins = {**plugins, "architecture": default_plugin("architecture")}
    objective = plugins.get("objective")
    arch = plugins["architecture"]
    kind = family(arch, objective)
    for attention in mixer_plugins(plugins):
        if kind == ENCODER_DECODER and not attention.cross_attention:
            raise UserError(f"attention plugin {attention.name!r} has no cross-attention, which an encoder-decoder "
                            "model's decoder needs; use one that declares it (Attention.cross_attention: mha, gqa, "
                            "mqa)", key="attention.use")
        if kind != DECODER and not attention.bidirectional:
            who = "an encoder-decoder model's encoder" if kind == ENCODER_DECODER else \
                f"objective {objective.name!r}"
            raise UserError(f"attention plugin {attention.name!r} is causal only, and {who} needs bidirectional "
                            "attention; use one that declares it (Attention.bidirectional; see `lmlab plugins "
                            "attention`)", key="attention.use")
    if kind == ENCODER:  # position schemes that tell the two directions apart build for both
        shape = dataclasses.replace(shape, causal=False)
    parts = ModelParts(shape=shape, family=kind, position=plugins["position"], attention=plugins["attention"],
                       ffn=plugins["ffn"], norm=model.norm, norm_eps=model.norm_eps,
                       tie_embeddings=model.tie_embeddings, heads=objective.heads(shape) if objective is not None else None,
                       decoder_start_id=decoder_start_id if kind == ENCODER_DECODER else None,
                       components=components_of(arch))
    return arch.build(parts)
