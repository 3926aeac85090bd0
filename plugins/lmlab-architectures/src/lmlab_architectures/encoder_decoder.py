"""``[architecture] use = "encoder-decoder"``: the encoder–decoder transformer (T5, Raffel et al. 2020;
BART, Lewis et al. 2020), assembled from the same position, attention and ffn plugins as the
decoder-only model.

The encoder is a stack of the decoder-only model's blocks built bidirectional (``ModelShape.causal``
False); each decoder block adds, between its self-attention and its ffn, a cross-attention from the
attention plugin (``Attention.build_cross``) over the encoder's output. The decoder side keeps the
decoder-only model's names (``tok_emb``, ``position``, ``blocks``, ``norm_f``, ``head``), so the
generation engine, which reads ``model.blocks`` and ``model.position``, decodes its self-attention
as it does a GPT's; the encoder's parts are ``enc_emb``, ``enc_position``, ``enc_blocks`` and
``enc_norm``.

It reads Hugging Face T5 checkpoints for ``[init] from`` (:mod:`lmlab_architectures.hf_t5`).
"""

import dataclasses

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lmlab.api import Architecture, Field, MixerContext, ModelParts, ModelShape, Options, UserError
from lmlab.api.architecture import CHECKPOINTING, Block, build_norm, num_params, param_infos
from lmlab_architectures import hf_t5
from lmlab_architectures.hf_files import ReadsHF


class DecoderBlock(nn.Module):
    """Pre-norm residual block with cross-attention: x + self(norm1(x)), x + cross(norm_cross(x), memory),
    then x + ffn(norm2(x))."""

    def __init__(self, shape: ModelShape, norm: str, norm_eps: float, attention, ffn, layer: int):
        super().__init__()
        self.norm1 = build_norm(norm, shape, norm_eps)
        self.attn = attention.build(shape, layer)
        self.norm_cross = build_norm(norm, shape, norm_eps)
        self.cross = attention.build_cross(shape, layer)
        self.ffn = ffn.build(shape, layer)
        self.has_ffn = not getattr(self.ffn, "skip", False)
        self.norm2 = build_norm(norm, shape, norm_eps) if self.has_ffn else nn.Identity()
        self.dropout = nn.Dropout(shape.dropout) if shape.dropout else nn.Identity()
        self.checkpointing = "none"

    def forward(self, x: torch.Tensor, ctx: MixerContext, state=None, cross_state=None) -> torch.Tensor:
        policy = self.checkpointing if self.training and torch.is_grad_enabled() else "none"
        if policy == "full":
            return checkpoint(self._forward, x, ctx, state, cross_state, use_reentrant=False)
        if policy == "attention":
            x = checkpoint(self._attend, x, ctx, state, cross_state, use_reentrant=False)
        else:
            x = self._attend(x, ctx, state, cross_state)
        if not self.has_ffn:
            return x
        if policy == "ffn":
            return x + checkpoint(self._feed_forward, x, use_reentrant=False)
        return x + self._feed_forward(x)

    def _forward(self, x, ctx, state, cross_state):
        x = self._attend(x, ctx, state, cross_state)
        return x + self._feed_forward(x) if self.has_ffn else x

    def _attend(self, x, ctx, state, cross_state):
        x = x + self.dropout(self.attn(self.norm1(x), ctx, state))
        return x + self.dropout(self.cross(self.norm_cross(x), ctx, cross_state))

    def _feed_forward(self, x):
        return self.dropout(self.ffn(self.norm2(x)))


class EncoderDecoderModel(nn.Module):
    """Encoder: embedding → position → bidirectional blocks → norm. Decoder: embedding (shared by
    default) → position → causal blocks with cross-attention → norm → (tied) head."""

    def __init__(self, shape: ModelShape, *, position, attention, ffn, norm: str = "layernorm",
                 norm_eps: float = 1e-5, tie_embeddings: bool = True, encoder_layers: int | None = None,
                 share_embeddings: bool = True, decoder_start_id: int = 0, heads=None):
        super().__init__()
        self.decoder_start_id = decoder_start_id  # what generation feeds the decoder first
        self.shape = shape  # the decoder's; the encoder's differs in n_layers and causal
        self.encoder_shape = dataclasses.replace(shape, n_layers=encoder_layers or shape.n_layers, causal=False)
        self.causal = True  # the decoder generates left to right
        self.block_size, self.vocab_size = shape.block_size, shape.vocab_size
        self.tok_emb = nn.Embedding(shape.vocab_size, shape.d_model)
        self.enc_emb = self.tok_emb if share_embeddings else nn.Embedding(shape.vocab_size, shape.d_model)
        self.enc_position = position.build(self.encoder_shape)
        self.enc_blocks = nn.ModuleList(Block(self.encoder_shape, norm, norm_eps, attention, ffn, i)
                                        for i in range(self.encoder_shape.n_layers))
        self.enc_norm = build_norm(norm, shape, norm_eps)
        self.position = position.build(shape)
        self.blocks = nn.ModuleList(DecoderBlock(shape, norm, norm_eps, attention, ffn, i)
                                    for i in range(shape.n_layers))
        self.norm_f = build_norm(norm, shape, norm_eps)
        self.head = nn.Linear(shape.d_model, shape.vocab_size, bias=False)
        if tie_embeddings:
            self.head.weight = self.tok_emb.weight
        self.dropout = nn.Dropout(shape.dropout) if shape.dropout else nn.Identity()
        self.span = (0, shape.n_layers)
        self.reset_parameters()
        self.heads = nn.ModuleDict(dict(heads)) if heads else None

    def reset_parameters(self) -> None:
        std = self.shape.init_std
        for emb in {id(m): m for m in (self.tok_emb, self.enc_emb)}.values():
            nn.init.normal_(emb.weight, 0.0, std)
        if self.head.weight is not self.tok_emb.weight:
            nn.init.normal_(self.head.weight, 0.0, std)
        self.enc_position.reset_parameters(self.encoder_shape)
        self.position.reset_parameters(self.shape)
        for block in self.enc_blocks:
            block.attn.reset_parameters(self.encoder_shape)
            block.ffn.reset_parameters(self.encoder_shape)
        for block in self.blocks:
            block.attn.reset_parameters(self.shape)
            block.cross.reset_parameters(self.shape)
            block.ffn.reset_parameters(self.shape)
        norms = [self.enc_norm, self.norm_f] + [getattr(b, name) for b in (*self.enc_blocks, *self.blocks)
                                                for name in ("norm1", "norm_cross", "norm2") if hasattr(b, name)]
        for norm in norms:
            if not isinstance(norm, nn.Identity):  # a block without an ffn has no norm2
                norm.reset_parameters()

    def set_checkpointing(self, policy: str) -> None:
        """Activation checkpointing for every block of both stacks: one of CHECKPOINTING."""
        if policy not in CHECKPOINTING:
            raise ValueError(f"checkpointing must be one of {CHECKPOINTING}, got {policy!r}")
        for block in (*self.enc_blocks, *self.blocks):
            block.checkpointing = policy

    @property
    def max_context(self) -> int | None:
        return self.position.max_positions

    def pipeline_stage(self, start: int, stop: int) -> None:
        raise UserError("an encoder-decoder model cannot be split into pipeline stages yet; use data parallelism "
                        "or FSDP", key="parallel.use")

    def encode(self, ids: torch.Tensor, padding: torch.Tensor | None = None) -> torch.Tensor:
        """The encoder's output (B, S, C) for ``ids`` (B, S); ``padding`` (B, S) True where no token is."""
        S = ids.shape[1]
        limit = self.enc_position.max_positions
        if limit is not None and S > limit:
            raise ValueError(f"the encoder reads at most {limit} tokens (model.block_size); got {S}")
        positions = torch.arange(S, device=ids.device)
        # Padding is a key mask (API 1.13 widens MixerContext.key_mask from ragged decoding to padded
        # encoder rows): real tokens never attend to it, and its own outputs are never attended either.
        key_mask = None if padding is None else (~padding)[:, None, None, :].expand(-1, 1, S, S)
        ctx = MixerContext(position=self.enc_position, positions=positions, causal=False, key_mask=key_mask)
        x = self.dropout(self.enc_position.embed(self.enc_emb(ids), positions))
        for block in self.enc_blocks:
            x = block(x, ctx)
        return self.enc_norm(x)

    def forward(self, idx: torch.Tensor, cache=None, encoder_ids: torch.Tensor | None = None,
                encoder_padding: torch.Tensor | None = None, hidden: bool = False):
        """Decoder tokens idx (B, T) → logits (B, T, V), reading ``encoder_ids`` (B, S) through the
        encoder; in decoding, ``cache`` holds each layer's cross-attention keys and values instead."""
        start = cache.length if cache is not None else 0
        T = idx.shape[1]
        cross = getattr(cache, "cross", None)
        if cross is not None:  # decoding: the rows' encoder keys and values, computed once per prompt
            memory, padding = None, cache.memory_padding
        else:
            if encoder_ids is None:
                raise ValueError("an encoder-decoder model needs encoder_ids (Seq2SeqBatch.model_inputs)")
            padding = _at_least_one_key(encoder_padding)
            memory = self.encode(encoder_ids, padding)
            cross = (None,) * len(self.blocks)
        positions = getattr(cache, "positions", None)
        if positions is not None:
            ctx = MixerContext(position=self.position, positions=positions, start=start, causal=True,
                               key_mask=cache.key_mask, memory=memory, memory_padding=padding)
        else:
            if self.max_context is not None and start + T > self.max_context:
                raise ValueError(f"positions up to {start + T - 1} requested; the decoder's position scheme covers "
                                 f"0..{self.max_context - 1} (model.block_size)")
            positions = torch.arange(start, start + T, device=idx.device)
            ctx = MixerContext(position=self.position, positions=positions, start=start, causal=True,
                               memory=memory, memory_padding=padding)
        x = self.dropout(self.position.embed(self.tok_emb(idx), positions))
        states = cache.states if cache is not None else (None,) * len(self.blocks)
        for block, state, cross_state in zip(self.blocks, states, cross):
            x = block(x, ctx, state, cross_state)
        if cache is not None:
            cache.length = start + T
        x = self.norm_f(x)
        return x if hidden else self.head(x)

    def aux_loss(self) -> torch.Tensor | None:
        ffns = [b.ffn for b in (*self.enc_blocks, *self.blocks)]
        losses = [f.aux_loss for f in ffns if getattr(f, "aux_loss", None) is not None]
        return torch.stack(losses).sum() if losses else None

    def new_cache(self, batch_size: int, max_len: int):
        raise ValueError("an encoder-decoder model decodes through its own generation engine "
                         "(make_engine), which runs the encoder once per prompt")

    def make_engine(self, rows: int, max_len: int, **settings):
        """The generation engine (``LanguageModel``'s ``make_engine``, API 1.18): the shared key/value
        store for the decoder, and each row's encoder output computed once."""
        from lmlab_architectures.seq2seq_engine import seq2seq_engine  # generation code, not needed to train

        return seq2seq_engine(self, rows, max_len, **settings)

    def param_infos(self):
        return param_infos(self)

    def num_params(self, trainable_only: bool = False) -> int:
        return num_params(self, trainable_only)


def _at_least_one_key(padding: torch.Tensor | None) -> torch.Tensor | None:
    """The padding with each wholly padded row's first position unmasked: attention over no key at all
    is 0/0 (NaN); such a row (a record with an empty prompt) reads one padding token instead."""
    if padding is None or not bool(padding.all(dim=1).any()):
        return padding
    first = torch.zeros_like(padding)
    first[:, 0] = True
    return padding & ~(first & padding.all(dim=1, keepdim=True))


class EncoderDecoderOptions(Options):
    encoder_layers: int | None = Field(
        None, gt=0, le=10_000, help="blocks of the encoder (default: model.n_layers, which counts the decoder's)")
    share_embeddings: bool = Field(True, help="one token embedding for the encoder and the decoder (T5, BART)")
    decoder_start_id: int | None = Field(
        None, ge=0, help="the id the decoder's input starts with (default: the tokenizer's end-of-document id; 0 "
                         "for a T5 checkpoint)")


class EncoderDecoder(ReadsHF, Architecture):
    """Encoder–decoder (T5, BART): a bidirectional encoder and a causal decoder that cross-attends to it."""

    api = ">=1.18,<2"  # Architecture
    Options = EncoderDecoderOptions
    families = ("encoder-decoder",)
    hf_model_types = {hf_t5.MODEL_TYPE: "T5"}
    hf_readers = {hf_t5.MODEL_TYPE: hf_t5}

    def decoder_start_id(self, eos_id: int | None) -> int | None:
        own = self.options.decoder_start_id
        return own if own is not None else (eos_id if eos_id is not None else 0)

    def build(self, parts: ModelParts) -> EncoderDecoderModel:
        o = self.options
        return EncoderDecoderModel(parts.shape, position=parts.position, attention=parts.attention, ffn=parts.ffn,
                                   norm=parts.norm, norm_eps=parts.norm_eps, tie_embeddings=parts.tie_embeddings,
                                   encoder_layers=o.encoder_layers, share_embeddings=o.share_embeddings,
                                   decoder_start_id=parts.decoder_start_id if parts.decoder_start_id is not None
                                   else self.decoder_start_id(None), heads=parts.heads)
