"""Early exit (``[architecture] exit_layers``, ``exit_threshold``): light exit heads after some blocks,
trained beside the output head, and decoding that leaves at the first confident one.

Training (BranchyNet, Teerapittayanon et al. 2016; CALM, Schuster et al. 2022; the Depth-Adaptive
Transformer, Elbayad et al. 2020): after block i an exit head normalises the hidden state for the
shared output head, as the final norm does for the last block, so an exit adds a norm and no matrix.
The loss is the output head's plus ``exit_loss_weight`` times the mean of the exits' losses on the
same targets (the core scores a model's ``extra_heads``); ``train_only_exits`` trains the exit heads
alone on a trained model (``[init] from`` it: each exit starts as a copy of the final norm, the
"logit lens"), every other weight frozen.

Decoding: each new token runs the blocks in order and leaves at the first exit head whose
confidence, the max softmax probability, is at least ``exit_threshold`` (CALM's softmax response),
or runs them all and takes the output head. Easy tokens then cost fewer blocks. The model supplies
its own engine (``make_engine``), so every one-token-per-step decoder (greedy, sample, a third
party's) decodes through it, in ``lmlab generate`` and ``lmlab serve``.

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

Rows are decoded one at a time, each through per-block states of the model's attention plugins
(``AttentionModule.new_state``); a sequence that outgrows the model's context restarts from its most
recent ``window - 1`` tokens through every block, as the core's engine does. A prompt, or such a
restart, runs every block at every position; the exit that gives its next token is chosen from its
last position's hidden states.
"""

from dataclasses import dataclass

import torch
from pydantic import model_validator
from torch import nn

from lmlab.api import Field, MixerContext, Options, TokenDecoder, UserError
from lmlab.api.architecture import Stack, build_norm

PROPAGATION = ("copy", "exact")
KEY = "architecture.exit_threshold"


class ExitOptions(Options):
    """Early exit's options, which the decoder architectures (``decoder``, ``parallel-block``) have."""

    exit_layers: list[int] = Field(
        [], help="early exit: blocks (0-based) after which a light exit head sits (its own norm, then the shared "
                 "output head), each below model.n_layers - 1")
    exit_loss_weight: float = Field(
        1.0, ge=0, help="the loss is the output head's plus this times the mean of the exit heads' losses on the "
                        "same targets (train/val loss report the output head's alone)")
    train_only_exits: bool = Field(
        False, help="train the exit heads alone, every other weight frozen (early exit on a trained model: "
                    "[init] from = \"<run>\")")
    exit_threshold: float | None = Field(
        None, ge=0, le=1, help="decoding: leave at the first exit head whose max softmax probability is >= this "
                               "(1.0 never exits; 0.0 always takes the first); with any one-token-per-step decoder; "
                               "set it when decoding (lmlab generate --set architecture.exit_threshold=0.9)")

    @model_validator(mode="after")
    def _increasing(self):
        if self.exit_layers != sorted(set(self.exit_layers)):
            raise UserError(f"must be increasing block indices without repeats, got {self.exit_layers}",
                            key="architecture.exit_layers")
        return self


#: The options a run from an [init] may set otherwise: exit heads the init lacks start from its final norm.
FREE_OPTIONS = frozenset({"exit_layers", "exit_loss_weight", "train_only_exits", "exit_threshold"})


def check_layers(options: ExitOptions, n_layers: int) -> None:
    # The last block's exit is the model's own head: an exit head there would duplicate it.
    wrong = [i for i in options.exit_layers if not 0 <= i < n_layers - 1]
    if wrong:
        raise UserError(f"block {wrong[0]} cannot hold an exit head: exits sit after blocks 0..{n_layers - 2} "
                        f"(model.n_layers = {n_layers}; the last block's exit is the model's head)",
                        key="architecture.exit_layers")
    if options.train_only_exits and not options.exit_layers:
        raise UserError("needs exit heads to train: set architecture.exit_layers (blocks after which an exit head "
                        "sits)", key="architecture.train_only_exits")
    if options.exit_threshold is not None and not options.exit_layers:
        raise UserError("needs exit heads, and this model has none: train with architecture.exit_layers (on a "
                        "trained run: [init] from it, with architecture.train_only_exits = true)", key=KEY)


def check(options: ExitOptions, context) -> None:
    """What early exit cannot do in this variant, found by ``lmlab check``."""
    check_layers(options, context.shape.n_layers)
    if not options.exit_layers:
        return
    objective, decoder = context.plugins.get("objective"), context.plugins.get("decoding")
    if objective is not None and objective.runs_model():
        raise UserError(f"exit heads are trained by the objectives that score logits; objective {objective.name!r} "
                        "runs the model itself: leave architecture.exit_layers empty",
                        key="architecture.exit_layers")
    parallel = context.plugins.get("parallel")
    if parallel is not None and parallel.runs_forward_backward:  # pipeline stages
        raise UserError(f"exit heads cannot be trained in pipeline stages ({parallel.name!r}): every exit needs the "
                        "output head, which only the last stage holds", key="architecture.exit_layers")
    if options.train_only_exits and context.plugins.get("peft") is not None:
        raise UserError("trains the exit heads alone; a [peft] adapter would be another set of trained weights: use "
                        "one or the other", key="architecture.train_only_exits")
    if options.exit_threshold is not None and decoder is not None and not isinstance(decoder, TokenDecoder):
        raise UserError(f"early exit decodes one token per step, with greedy, sample or another token decoder; "
                        f"{decoder.name!r} is not one (leave architecture.exit_threshold unset)", key=KEY)


class ExitStack(Stack):
    """The decoder stack with exit heads after ``exit_layers`` (the core's ``extra_heads``)."""

    extra_losses_name = "exit_losses"

    def __init__(self, shape, *, exit_layers, exit_loss_weight: float = 1.0, train_only_exits: bool = False,
                 exit_threshold: float | None = None, **parts):
        # Set before Stack's __init__, which adds the exit heads (add_modules) before initialising.
        self.exit_layers = tuple(exit_layers)
        self.extra_heads = tuple(str(i) for i in self.exit_layers)
        self.extra_loss_weight = exit_loss_weight
        self.exit_threshold = exit_threshold
        super().__init__(shape, **parts)
        if train_only_exits:  # BranchyNet's branches trained on a fixed network; the tied head stays frozen
            self.requires_grad_(False)
            self.exit_heads.requires_grad_(True)

    def add_modules(self) -> None:
        self.exit_heads = nn.ModuleDict({str(i): build_norm(self.norm_name, self.shape, self.norm_eps)
                                         for i in self.exit_layers})

    def reset_parameters(self) -> None:
        super().reset_parameters()
        for norm in self.exit_heads.values():
            norm.reset_parameters()

    def extra_logits(self, layer: int, x: torch.Tensor) -> torch.Tensor | None:
        head = self.exit_heads[str(layer)] if layer in self.exit_layers else None
        return None if head is None else self.head(head(x))

    def init_missing(self, state: dict, missing: list[str]) -> list[str]:
        # Exit heads added to a model trained without them start as copies of the final norm, so each
        # exit begins by reading its block's hidden state as the output head reads the last one.
        own = self.state_dict(keep_vars=True)
        for name in [k for k in missing if k.startswith("exit_heads.")]:
            final = "norm_f." + name.split(".", 2)[2]
            if final in state and state[final].shape == own[name].shape:
                state[name] = state[final]
        return [k for k in missing if not k.startswith("exit_heads.")]

    def make_engine(self, rows: int, max_len: int, **settings):
        """Early-exit decoding when ``exit_threshold`` is set, else the core's engine (None)."""
        if self.exit_threshold is None:
            return None
        return EarlyExitEngine(self, rows, max_len, self.exit_threshold)


def check_model(model) -> None:
    """A UserError naming the threshold unless ``model`` is a whole causal model with exit heads."""
    if not getattr(model, "exit_layers", ()):
        raise UserError("needs exit heads, and this model has none: train with architecture.exit_layers (on a "
                        "trained run: [init] from it, with architecture.train_only_exits = true)", key=KEY)
    if model.span != (0, len(model.blocks)) or not model.causal:
        raise UserError("needs a whole causal model", key=KEY)


class EarlyExitRow:
    """One sequence decoded with early exits: :meth:`start` with the prompt, then :meth:`step` per
    token; each returns the logits (V,) float32 for the next token and the exit layer it came from
    (blocks run, 1-based: ``n_layers`` for the output head).

    Args:
        model: An [ExitStack][lmlab_architectures.early_exit.ExitStack], in eval mode; call under no_grad.
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


class EarlyExitEngine:
    """The ``lmlab.api.Engine`` of an [ExitStack][lmlab_architectures.early_exit.ExitStack] decoded
    with early exits: each row is an :class:`EarlyExitRow` with its own per-block states, fed one
    token per step (so greedy, sample and any other token decoder run through it unchanged)."""

    def __init__(self, model: ExitStack, rows: int, max_len: int, threshold: float, propagate: str = "copy"):
        check_model(model)
        self.model, self.vocab_size = model, model.vocab_size
        self.threshold, self.max_len, self.propagate = threshold, max_len, propagate
        self.free_rows = list(range(rows))
        self.rows: dict[int, EarlyExitRow] = {}
        self.stats = ExitStats(len(model.blocks))

    def add(self, prompts: list[list[int]]) -> tuple[list[int], torch.Tensor]:
        if len(prompts) > len(self.free_rows):
            raise ValueError(f"{len(prompts)} prompts for {len(self.free_rows)} free rows")
        rows, logits = [], []
        for ids in prompts:
            row = self.free_rows.pop(0)
            self.rows[row] = EarlyExitRow(self.model, self.threshold, self.max_len, self.propagate)
            out, layer = self.rows[row].start(list(ids))
            self.stats.add(layer)
            rows.append(row)
            logits.append(out)
        return rows, torch.stack(logits)

    def step(self, rows: list[int], tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape[1] != 1:
            self._one_token()
        out = []
        for row, token in zip(rows, tokens[:, 0].tolist()):
            logits, layer = self.rows[row].step(int(token))
            self.stats.add(layer)
            out.append(logits)
        return torch.stack(out)[:, None]

    def release(self, rows: list[int]) -> None:
        for row in rows:
            del self.rows[row]
            self.free_rows.append(row)

    def length(self, row: int) -> int:
        return len(self.rows[row].tokens)

    def rewind(self, rows, counts) -> None:
        self._one_token()

    def fork(self, rows):
        self._one_token()

    def assign(self, dst, src) -> None:
        self._one_token()

    def companion(self, model):
        self._one_token()

    def report(self) -> str:
        return f"exit threshold {self.threshold:g}, average exit layer {self.stats.mean:.2f} of {self.stats.n_layers}"

    @staticmethod
    def _one_token():
        raise UserError("early exit decodes one token per step, with greedy, sample or another token decoder "
                        "(leave architecture.exit_threshold unset for this decoder)", key=KEY)


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
