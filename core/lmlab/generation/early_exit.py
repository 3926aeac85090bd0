"""Early-exit decoding (``decoding.exit_threshold``, with a run trained with ``model.exit_layers``).

Each new token runs the blocks in order and leaves at the first exit head whose confidence, the max
softmax probability, is at least the threshold (BranchyNet, Teerapittayanon et al. 2016; the
softmax-response measure of CALM, Schuster et al. 2022; Elbayad et al. 2020 decide per token the
same way), or runs them all and takes the output head. Easy tokens then cost fewer blocks.

A token that left after block ``e`` has no keys and values in the deeper blocks, which later tokens
attend to. CALM's *state propagation* fills them with its exit state ``h_e``: the deeper blocks
read ``h_e`` as that position's input. It is done lazily, as CALM does it: a block keeps its own
cache length, and the next token that reaches it feeds the positions it lacks (their hidden states)
together with its own in one forward pass of T > 1 through that block, from the block's own start.
So every block's cache stays a prefix of the sequence, and no block runs more often than when the
token that needs it arrives.

``propagate = "exact"`` (not a manifest option; ``bench/early_exit.py`` compares the two) feeds a
pending position the output of the previous block instead of its exit state: the chunk passes
through the blocks in order anyway, so the deferred positions get the hidden states, and the keys
and values, the full model would have given them, at the same cost (the synchronised parallel
decoding of FREE, Bae et al. 2023).

Rows are decoded one at a time (batch 1), each through per-block states of the model's attention
plugins (``AttentionModule.new_state``); a sequence that outgrows the model's context restarts from
its most recent ``window - 1`` tokens through every block, as the engine does
(``lmlab.generation.engine``). A prompt, or such a restart, runs every block at every position; the
exit that gives its next token is chosen from its last position's hidden states.
"""

from dataclasses import dataclass
from typing import Iterator

import torch

from lmlab.api.attention import MixerContext
from lmlab.api.decoding import TokenDecoder, TokenRows
from lmlab.errors import UserError

PROPAGATION = ("copy", "exact")


def check(decoder, model) -> None:
    """A UserError naming decoding.exit_threshold unless ``decoder`` picks one token per step
    (a ``TokenDecoder``: greedy, sample) and ``model`` is a whole causal model with exit heads."""
    if not isinstance(decoder, TokenDecoder):
        raise UserError(f"early exit decodes one token per step, with greedy or sample; {decoder.name!r} does "
                        "not (leave decoding.exit_threshold unset)", key="decoding.exit_threshold")
    check_model(model)


def check_model(model) -> None:
    """A UserError naming decoding.exit_threshold unless ``model`` is a whole causal model with exit heads."""
    key = "decoding.exit_threshold"
    if getattr(model, "exit_heads", None) is None:
        raise UserError("needs exit heads, and this model has none: train with model.exit_layers (on a trained run: "
                        "[init] from it, with train.train_only = \"exit_heads\")", key=key)
    if model.span != (0, len(model.blocks)) or not model.causal:
        raise UserError("needs a whole causal model", key=key)


class EarlyExitRow:
    """One sequence decoded with early exits: :meth:`start` with the prompt, then :meth:`step` per
    token; each returns the logits (V,) float32 for the next token and the exit layer it came from
    (blocks run, 1-based: ``n_layers`` for the output head).

    Args:
        model: A ``lmlab.model.LanguageModel`` with exit heads, in eval mode; call under no_grad.
        threshold: Leave at the first exit head whose max softmax probability is ≥ this; ≥ 1 never
            leaves (the exit heads are not even evaluated), so the logits are the full model's.
        max_len: The longest sequence to be fed, prompt included (capped at the model's context).
        propagate: What a deeper block reads for a position that left early: ``"copy"`` its exit
            state (CALM) or ``"exact"`` the previous block's output.
    """

    def __init__(self, model, threshold: float, max_len: int, propagate: str = "copy"):
        if propagate not in PROPAGATION:
            raise ValueError(f"propagate must be one of {PROPAGATION}, got {propagate!r}")
        check_model(model)
        self.model, self.threshold, self.exact = model, threshold, propagate == "exact"
        self.blocks = list(model.blocks)
        limit = model.max_context
        self.window = max_len if limit is None else min(max_len, limit)
        if self.window < 2:
            raise ValueError(f"a window of {self.window} positions cannot hold a prompt and a new token")
        # Exit heads by block, or none at all when no confidence can pass the threshold.
        self.exits = {i: model.exit_heads[str(i)] for i in model.exit_layers} if threshold < 1 else {}
        p = model.head.weight
        self.device = p.device
        self._arange = torch.arange(self.window, device=self.device)
        # Per position, the hidden state a block that lacks it reads (see propagate).
        self.hidden = torch.empty(1, self.window, model.shape.d_model, device=self.device, dtype=p.dtype)
        self.tokens: list[int] = []
        self.states: list = []
        self.lengths: list[int] = []  # positions each block's state holds

    def start(self, ids: list[int]) -> tuple[torch.Tensor, int]:
        """Consume the prompt (≥ 1 token) through every block; the logits after it and their exit layer."""
        if not ids:
            raise ValueError("a prompt needs at least one token")
        self.tokens = list(ids)
        return self._refill()

    def step(self, token: int) -> tuple[torch.Tensor, int]:
        """Feed one more token; the logits after it and the exit layer they came from."""
        p = len(self.tokens)  # its position
        self.tokens.append(token)
        if p + 1 > self.window:
            return self._refill()
        model = self.model
        positions = self._arange[p:p + 1]
        x = model.dropout(model.position.embed(model.tok_emb(torch.tensor([[token]], device=self.device)),
                                               positions))
        contexts: dict[int, MixerContext] = {}  # blocks that start at the same position share one, as a forward does
        for i, block in enumerate(self.blocks):
            s = self.lengths[i]
            ctx = contexts.get(s)
            if ctx is None:
                ctx = contexts[s] = MixerContext(position=model.position, positions=self._arange[s:p + 1], start=s,
                                                 causal=True)
            out = block(x if s == p else torch.cat([self.hidden[:, s:p], x], dim=1), ctx, self.states[i])
            self.lengths[i] = p + 1
            if self.exact and s < p:
                self.hidden[:, s:p] = out[:, :-1]
            x = out[:, -1:]
            head = self.exits.get(i)
            if head is not None:
                logits = model.head(head(x))[0, -1]
                if self._confident(logits):
                    self.hidden[:, p] = x[:, 0]  # what the blocks it skipped will read for it
                    return logits.float(), i + 1
        return model.head(model.norm_f(x))[0, -1].float(), len(self.blocks)

    def _confident(self, logits: torch.Tensor) -> bool:
        return bool(torch.softmax(logits.float(), dim=-1).max() >= self.threshold)

    def _refill(self) -> tuple[torch.Tensor, int]:
        """Every block over the most recent tokens that fit (room left for one more), from empty states."""
        if len(self.tokens) >= self.window:
            self.tokens = self.tokens[-(self.window - 1):]
        model, T = self.model, len(self.tokens)
        p = model.head.weight
        self.states = [b.attn.new_state(1, self.window, p.device, p.dtype) for b in self.blocks]
        self.lengths = [T] * len(self.blocks)
        positions = self._arange[:T]
        ctx = MixerContext(position=model.position, positions=positions, start=0, causal=True)
        x = model.dropout(model.position.embed(model.tok_emb(torch.tensor([self.tokens], device=self.device)),
                                               positions))
        chosen = None
        for i, block in enumerate(self.blocks):
            x = block(x, ctx, self.states[i])
            head = self.exits.get(i)
            if chosen is None and head is not None:
                logits = model.head(head(x[:, -1:]))[0, -1]
                if self._confident(logits):
                    chosen = logits.float(), i + 1
        # The head over every position, as the model's forward computes it, so the logits are its own.
        return chosen if chosen is not None else (model.head(model.norm_f(x))[0, -1].float(), len(self.blocks))


@dataclass
class ExitStats:
    """The exit layer of every token decoded: ``mean`` is the average exit layer (blocks run per
    token, the full model's being ``n_layers``)."""

    n_layers: int
    tokens: int = 0
    layers: int = 0

    def add(self, layer: int) -> None:
        self.tokens += 1
        self.layers += layer

    @property
    def mean(self) -> float:
        return self.layers / self.tokens if self.tokens else float(self.n_layers)


class EarlyExitDecoding:
    """A one-token-per-step decoder (a ``TokenDecoder``: ``greedy``, ``sample``)
    run with early exits: what ``lmlab generate`` drives instead of the decoder's own ``decode`` when
    ``decoding.exit_threshold`` is set. The same interface (``decode``), with no engine."""

    def __init__(self, decoder, model, threshold: float, max_len: int, propagate: str = "copy"):
        check(decoder, model)
        self.decoder, self.model, self.threshold = decoder, model, threshold
        self.max_len, self.propagate = max_len, propagate
        self.stats = ExitStats(len(model.blocks))

    def decode(self, engine, prompts: list[list[int]], outputs,
               generator: torch.Generator | None = None) -> Iterator[dict[int, list[int]]]:
        """As ``Decoder.decode``, prompt after prompt (``engine`` is not used: each row keeps its own
        per-block states)."""
        for i, ids in enumerate(prompts):
            row = EarlyExitRow(self.model, self.threshold, self.max_len, self.propagate)
            logits, layer = row.start(ids)
            while True:
                rows = TokenRows([self.decoder.options], [generator], logits.device)
                token = int(self.decoder.choose(logits[None], rows)[0])
                self.stats.add(layer)
                yield {i: [token]}
                if outputs.done(i):
                    break
                logits, layer = row.step(token)


@torch.inference_mode()
def teacher_forced(model, ids: list[int], threshold: float, propagate: str = "copy",
                   max_len: int | None = None) -> tuple[torch.Tensor, list[int]]:
    """The early-exit decoder fed ``ids`` (≥ 2 tokens) instead of its own choices: the negative
    log-likelihood (len(ids) - 1,) float32 of each next token under the logits it would have been
    chosen from, and their exit layers. With the first token as the prompt, every later one is
    scored with the states early exit leaves behind (the deferred keys and values included)."""
    row = EarlyExitRow(model, threshold, max_len or len(ids), propagate)
    logits, layer = row.start(ids[:1])
    scores, layers = [], []
    for t, token in enumerate(ids[1:], 1):
        scores.append(torch.log_softmax(logits, dim=-1)[token])
        layers.append(layer)
        if t < len(ids) - 1:
            logits, layer = row.step(token)
    return -torch.stack(scores), layers
