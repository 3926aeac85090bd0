"""The decoding slot: turns prompts into continuations.

Also the core's shared-cache engine, for a model whose decoding needs more than the shared key/value
store (API 1.18; see [LanguageModel][lmlab.api.model.LanguageModel]): ``SharedCacheEngine``, imported
on first use from this module, is the class a model's own engine subclasses (its docstring lists what
a subclass may use and override), and
[engine_supports_rows][lmlab.api.decoding.engine_supports_rows] says whether a model can decode through it.
"""

from typing import Any, Callable, ClassVar, Iterator, Literal, Protocol, Sequence

import torch
from pydantic import model_validator

from lmlab.api.options import Field, Options
from lmlab.api.cache import InferenceCache
from lmlab.api.model import LanguageModel
from lmlab.api.plugin import Plugin


class DecodingOptions(Options):
    """Options every decoder has (API 1.8): how the core keeps the inference cache. A plugin's
    options subclass these; ``lmlab generate --cache`` overrides ``cache`` for one command."""

    cache: Literal["contiguous", "paged"] = Field(
        "contiguous", help='the key/value cache: "contiguous" (every sequence reserves its longest length) or '
                           '"paged" (blocks taken as a sequence grows, freed when it ends)')
    block_size: int = Field(16, ge=1, help="positions per block of the paged cache")
    cuda_graph: bool = Field(False, help="on CUDA, replay the one-token decode step as a captured CUDA graph "
                                         "(contiguous cache); ignored elsewhere")
    compile: bool = Field(False, help="compile the one-token decode step with torch.compile (contiguous cache, "
                                      "fixed shapes): seconds of compiling once, then a faster step")

    @model_validator(mode="before")
    @classmethod
    def _moved_early_exit(cls, values):
        from lmlab.api.architecture import refuse_moved_early_exit

        refuse_moved_early_exit("decoding", values)
        return values


class Engine(Protocol):
    """Sequences decoded together over one model (API 1.8): what
    [Decoder.decode][lmlab.api.decoding.Decoder.decode] drives. The core's engine
    (``lmlab.generation``) keeps each sequence in a row of its inference cache, each row with its own
    length, so rows of different lengths advance in one forward pass; with an attention plugin
    that gives no [kv_layout][lmlab.api.attention.AttentionModule.kv_layout] (a recurrent mixer), it
    feeds the rows one at a time, with the same results.

    Rows are small integers the engine hands out; logits are float32. Once a row holds as many
    tokens as the model's context, the engine keeps its most recent ones (a sliding window, as
    nanoGPT's sampler crops its input), so a decoder never sees a context error.
    """

    model: LanguageModel
    """The model decoded."""
    vocab_size: int
    """The logits' last dimension V."""

    def add(self, prompts: list[list[int]]) -> tuple[list[int], torch.Tensor]:
        """Start one row per prompt (each at least one token); return the rows and the logits (N, V)
        for each prompt's next token."""

    def step(self, rows: list[int], tokens: torch.Tensor) -> torch.Tensor:
        """Append tokens (B, T) int64 to rows (B of them, distinct); return the logits (B, T, V):
        ``[b, t]`` scores the token after ``tokens[b, t]``. T > 1 verifies several tokens at once
        (speculative decoding)."""

    def rewind(self, rows: list[int], counts: list[int]) -> None:
        """Drop the last ``counts[i]`` tokens of ``rows[i]`` (rejected draft tokens); they must not
        reach back past a slide of the window. ``NotImplementedError`` from an engine whose model's
        states cannot rewind (a recurrent mixer)."""

    def fork(self, rows: list[int]) -> list[int]:
        """New rows, one per entry of ``rows`` (repeats allowed), each a copy of that row's sequence."""

    def assign(self, dst: list[int], src: list[int]) -> None:
        """Make each row ``dst[i]`` a copy of row ``src[i]`` as it was before the call (beam search's
        re-selection; a row may be copied to several others)."""

    def release(self, rows: list[int]) -> None:
        """Free rows whose sequences have ended; their memory serves the next ones."""

    def length(self, row: int) -> int:
        """Tokens the row holds (prompt included)."""

    def companion(self, model: LanguageModel) -> "Engine":
        """A new engine over another model (a speculative decoder's draft) with this one's cache
        settings."""

    def report(self) -> str | None:
        """Optional (API 1.19): a few words on how the engine decoded, which ``lmlab generate`` prints
        with its speed in place of the cache's name (a model's own engine: early exit's average exit
        layer)."""


class Outputs(Protocol):
    """Where a decoder's tokens go, one entry per prompt (API 1.8): the core records each prompt's
    tokens, streams their text, and says when a prompt is finished: at the tokenizer's EOS, at a
    stop string (cut out of the text), or after its own most new tokens."""

    eos_id: int | None
    """The end-of-text id, or None."""

    def max_new_tokens(self, i: int) -> int:
        """The most tokens prompt i may add (≥ 1)."""

    def done(self, i: int) -> bool:
        """Whether prompt i is finished, counting every token yielded for it so far."""

    def ends(self, i: int, tokens: list[int]) -> bool:
        """Whether ``tokens`` (a continuation of prompt i) reach its end: EOS, a stop string, or the
        token limit. For a decoder that weighs whole continuations before yielding (beam search)."""

    def offer(self, i: int, candidates: list[tuple[list[int], float]]) -> None:
        """Record prompt i's ranked alternatives, best first, each (tokens, score) (beam search's
        n-best); the decoder still yields the tokens of the best."""


class Decoder(Plugin):
    """How text is generated from a trained model.

    [decode][lmlab.api.decoding.Decoder.decode] (API 1.8) continues a batch of prompts of any lengths
    over an [Engine][lmlab.api.decoding.Engine], yielding tokens as they are made; ``lmlab
    generate`` streams them. ``lmlab serve`` takes only a
    [TokenDecoder][lmlab.api.decoding.TokenDecoder], whose per-token choice it batches. A plugin written for API < 1.8
    implements only [generate][lmlab.api.decoding.Decoder.generate], which the core then calls per
    prompt. Used also for the sample ``lmlab run`` prints at the end of a causal run; a model trained
    with a bidirectional objective is never given to a decoder.
    """

    slot = "decoding"
    Options = DecodingOptions
    needs_runs: ClassVar[tuple[str, ...]] = ()
    """Option names whose values are other run folders the decoder loads (a speculative decoder's
    ``draft``): the core loads each and passes them as ``runs`` to
    [prepare][lmlab.api.decoding.Decoder.prepare], after checking they share the target's
    tokenizer (API 1.8)."""

    def report(self) -> str | None:
        """A few words ``lmlab generate`` prints with its speed (API 1.21): an acceptance rate."""
        return None

    def rows_per_prompt(self) -> int:
        """Engine rows one prompt may hold at once (beam search: its width); the core sizes the
        engine by it (API 1.8). Default 1."""
        return 1

    def prepare(self, target: LanguageModel, runs: dict[str, LanguageModel]) -> None:
        """Called once before decoding with the target model and the models of
        [needs_runs][lmlab.api.decoding.Decoder.needs_runs] (on the target's device, eval mode).
        Default: nothing."""

    def decode(self, engine: Engine, prompts: list[list[int]], outputs: Outputs,
               generator: torch.Generator | None = None) -> Iterator[dict[int, list[int]]]:
        """Continue every prompt, yielding ``{prompt index: new tokens}`` as tokens are made.

        Called under ``torch.no_grad()`` with the model in eval mode. After each yield the core has
        recorded the tokens; check [Outputs.done][lmlab.api.decoding.Outputs.done] and stop feeding
        (and [release][lmlab.api.decoding.Engine.release]) the rows of prompts that are. Tokens
        yielded for a finished prompt are ignored, so a decoder may finish a step before checking.

        Args:
            engine: The model's engine, with no rows yet; start rows with ``engine.add(prompts)``.
            prompts: Token ids, each at least one.
            outputs: Per-prompt limits and the finished flags.
            generator: The random generator to draw from (seeded), or None for the global one.

        Yields:
            Dicts of prompt index → tokens made for it since the last yield. Default: ``generate``
            per prompt (plugins written for API < 1.8).
        """
        if type(self).generate is Decoder.generate:
            raise NotImplementedError(f"{type(self).__name__} implements neither decode nor generate")
        device = next(engine.model.parameters()).device
        for i, ids in enumerate(prompts):
            prompt = torch.tensor([ids], dtype=torch.long, device=device)
            out = self.generate(engine.model, prompt, outputs.max_new_tokens(i), eos_id=outputs.eos_id,
                                generator=generator)
            yield {i: out[0, len(ids):].tolist()}

    def generate(self, model: LanguageModel, prompt: torch.Tensor, max_new_tokens: int,
                 eos_id: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Continue ``prompt`` by at most ``max_new_tokens`` tokens (the API < 1.8 entry point).

        The default runs [decode][lmlab.api.decoding.Decoder.decode] over the core's engine.

        Args:
            model: The trained model: ``model(idx, cache)`` gives logits (B, T, V) in the
                parameters' dtype.
            prompt: (B, T) int64 token ids on the model's device, T ≥ 1.
            max_new_tokens: How many tokens to add at most, ≥ 1.
            eos_id: The tokenizer's end-of-document id, or None. A row that emits it is finished:
                it is padded with ``eos_id`` until every row is.
            generator: The random generator to draw from (on the model's device, seeded by
                ``--seed`` or the run's seed), so that sampling is reproducible; None draws from
                the global one.

        Returns:
            Token ids (B, T + n) int64 with n ≤ ``max_new_tokens``, beginning with ``prompt``
            unchanged.
        """
        if type(self).decode is Decoder.decode:
            raise NotImplementedError(f"{type(self).__name__} implements neither decode nor generate")
        from lmlab.generation.token_ids import generate_tensor

        return generate_tensor(self, model, prompt, max_new_tokens, eos_id=eos_id, generator=generator)


class TokenRows:
    """The rows of one decoding step as a [TokenDecoder][lmlab.api.decoding.TokenDecoder] sees them
    (API 1.17): each row's options and random generator.

    In ``lmlab generate`` every row has the decoder's own options and the one generator seeded by
    ``--seed``; in ``lmlab serve`` each row is a request, with the decoder's options as that request
    set them (the server's ``decoding.*`` values where it did not) and, for a request that gave a
    ``seed``, a generator of its own, so its text does not depend on the others decoded beside it.

    Args:
        options: One instance of the decoder's ``Options`` per row (the same object may repeat).
        generators: One random generator per row (the same object may repeat), or None for torch's
            global one.
        device: Where the step's logits are.
        history: A function giving each row's tokens so far, called when a decoder first reads
            [history][lmlab.api.decoding.TokenRows.history] (API 1.21); None: no history kept.
    """

    def __init__(self, options: Sequence[Any], generators: Sequence[torch.Generator | None],
                 device: torch.device | str = "cpu", history: Callable[[], list[list[int]]] | None = None):
        if len(options) != len(generators):
            raise ValueError(f"{len(options)} rows of options for {len(generators)} generators")
        self.options, self.generators, self.device = list(options), list(generators), torch.device(device)
        self._values: dict[tuple, torch.Tensor] = {}
        self._history_of = history
        self._history: list[list[int]] | None = None

    @property
    def history(self) -> list[list[int]] | None:
        """Each row's tokens so far, prompt included (API 1.21; None when none are kept)."""
        if self._history is None and self._history_of is not None:
            self._history = [list(h) for h in self._history_of()]
        return self._history

    def __len__(self) -> int:
        """The rows B."""
        return len(self.options)

    def values(self, name: str, default: float | int | None = None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Option ``name`` of every row as a (B,) tensor on the logits' device, a row's None given as
        ``default``: per-row parameters for one vectorised pass over the batch."""
        key = (name, default, dtype)
        if key not in self._values:
            raw = [getattr(o, name) for o in self.options]
            self._values[key] = torch.tensor([default if v is None else v for v in raw], dtype=dtype,
                                             device=self.device)
        return self._values[key]

    def select(self, index: Sequence[int]) -> "TokenRows":
        """The rows at ``index``, in that order (e.g. those a decoder samples rather than picks)."""
        history = None if self._history_of is None else (lambda: [self.history[i] for i in index])
        return TokenRows([self.options[i] for i in index], [self.generators[i] for i in index], self.device, history)

    def sample(self, probs: torch.Tensor) -> torch.Tensor:
        """One token id per row drawn from probs (B, V) (rows sum to 1), each row from its own
        generator: rows that share one are drawn together in one call, so ``lmlab generate`` draws
        exactly as a single ``torch.multinomial(probs, 1, generator=g)``."""
        groups: dict[int, list[int]] = {}
        for i, g in enumerate(self.generators):
            groups.setdefault(id(g), []).append(i)
        if len(groups) == 1:
            return torch.multinomial(probs, 1, generator=self.generators[0])[:, 0]
        out = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
        for index in groups.values():
            at = torch.tensor(index, device=probs.device)
            out[at] = torch.multinomial(probs.index_select(0, at), 1, generator=self.generators[index[0]])[:, 0]
        return out


class TokenDecoder(Decoder):
    """A decoder that picks each next token from that step's next-token logits alone, row by row
    (API 1.17): greedy, sampling and its truncations (top-k, top-p, min-p...).

    Implement [choose][lmlab.api.decoding.TokenDecoder.choose], vectorised over the rows of a step,
    each row with its own options. ``lmlab generate`` runs it through
    [decode][lmlab.api.decoding.TokenDecoder.decode] (one row per prompt, the loop below);
    ``lmlab serve`` calls it inside its continuous batching, one row per request, where a request's
    fields that name an option of the decoder's ``Options`` (not one of
    [DecodingOptions][lmlab.api.decoding.DecodingOptions]', which are the server's) set that option for
    that request, validated by the ``Options`` class. So one implementation serves both commands.
    A decoder that needs whole sequences (beam search, speculative decoding) subclasses
    [Decoder][lmlab.api.decoding.Decoder] instead, and ``lmlab serve`` refuses it.
    """

    api = ">=1.17,<2"  # TokenDecoder
    picks_most_likely: ClassVar[bool] = False
    """Every token chosen is the most likely one (API 1.21): ``lmlab serve`` then accepts a request's
    ``temperature: 0`` (what evaluation clients send), though the decoder has no such option."""

    def choose(self, logits: torch.Tensor, rows: TokenRows) -> torch.Tensor:
        """logits (B, V) float32 of one step → the next token ids (B,) int64, row b chosen with
        ``rows.options[b]``, drawing only from ``rows.generators[b]`` (``rows.sample``, ``rows.values``;
        never a Python loop over rows). Called under ``torch.no_grad()``."""
        raise NotImplementedError(f"{type(self).__name__} does not implement choose")

    def decode(self, engine: Engine, prompts: list[list[int]], outputs: Outputs,
               generator: torch.Generator | None = None) -> Iterator[dict[int, list[int]]]:
        """Every prompt gets a row; each step feeds one token per unfinished row and chooses the next from its
        logits. A finished prompt (EOS, a stop string, its limit) leaves the batch, its row released at once."""
        rows, logits = engine.add(prompts)
        live = list(range(len(prompts)))  # prompt indices, in the order of logits' rows
        seen = [list(p) for p in prompts]  # each prompt's tokens so far, for decoders that look back
        while True:
            step = TokenRows([self.options] * len(live), [generator] * len(live), logits.device,
                             lambda live=live: [seen[i] for i in live])
            tokens = self.choose(logits, step)  # (B,)
            chosen = tokens.tolist()
            for i, t in zip(live, chosen):
                seen[i].append(t)
            yield {i: [t] for i, t in zip(live, chosen)}
            keep = [j for j, i in enumerate(live) if not outputs.done(i)]
            if len(keep) < len(live):
                engine.release([rows[i] for j, i in enumerate(live) if outputs.done(i)])
                if not keep:
                    return
                live = [live[j] for j in keep]
                tokens = tokens[torch.tensor(keep, device=tokens.device)]
            logits = engine.step([rows[i] for i in live], tokens[:, None])[:, -1]


class Stepper:
    """Feeds tokens to a model one step at a time through its cache.

    Hides the context limit: once a sequence outgrows ``model.max_context``, the cache is rebuilt
    from the most recent tokens that fit (a sliding window), as nanoGPT's sampler crops its input.
    Call [start][lmlab.api.decoding.Stepper.start] once, then
    [step][lmlab.api.decoding.Stepper.step] per token, under ``torch.no_grad()``.

    Args:
        model: The model to feed (a causal one: bidirectional models have no cache).
        batch_size: Rows decoded together (B).
        max_len: The longest sequence that will be fed, prompt included; the cache holds
            ``min(max_len, model.max_context)`` positions.
    """

    def __init__(self, model: LanguageModel, batch_size: int, max_len: int):
        self.model = model
        self.batch_size = batch_size
        limit = model.max_context
        self.window = max_len if limit is None else min(max_len, limit)
        self.cache: InferenceCache = model.new_cache(batch_size, self.window)
        self.tokens: torch.Tensor | None = None

    def start(self, prompt: torch.Tensor) -> torch.Tensor:
        """Consume prompt (B, T) int64; return the logits (B, V) for the next token, in the model's
        dtype. A prompt longer than the cache's window is cropped to its last ``window - 1`` tokens."""
        self.tokens = prompt
        return self._refill()

    def step(self, next_tokens: torch.Tensor) -> torch.Tensor:
        """Append next_tokens (B,) int64, one per row; return the logits (B, V) for the token after
        them. One forward pass of one token; when the cache is full, instead one forward pass of the
        last ``window - 1`` tokens into a fresh cache."""
        self.tokens = torch.cat([self.tokens, next_tokens[:, None]], dim=1)
        if self.cache.length >= self.window:
            return self._refill()
        return self.model(next_tokens[:, None], cache=self.cache)[:, -1]

    def reorder(self, index: torch.Tensor) -> None:
        """Keep rows ``index`` (B',) int64, in that order, of the tokens and the cache (beam search
        re-ranking); later calls take B' rows."""
        self.tokens = self.tokens.index_select(0, index)
        self.cache.reorder(index)

    def _refill(self) -> torch.Tensor:
        # Keep room for at least one more token so a refill is needed at most every few steps.
        keep = self.tokens[:, -max(1, self.window - 1):] if self.tokens.shape[1] >= self.window else self.tokens
        self.cache = self.model.new_cache(self.tokens.shape[0], self.window)
        return self.model(keep, cache=self.cache)[:, -1]


def engine_supports_rows(model: LanguageModel) -> bool:
    """Whether ``model`` can decode through ``SharedCacheEngine`` (API 1.18): every block's attention
    gives a [kv_layout][lmlab.api.attention.AttentionModule.kv_layout] and its position module takes
    per-row positions. A model whose own engine subclasses it checks this first, and refuses otherwise."""
    from lmlab.generation.engine import supports_rows

    return supports_rows(model)


def __getattr__(name: str):
    # The engine is the core's generation code, imported on first use: a plugin that only declares a
    # decoder does not load it.
    if name == "SharedCacheEngine":
        from lmlab.generation.engine import Engine as SharedCacheEngine

        return SharedCacheEngine
    raise AttributeError(f"module 'lmlab.api.decoding' has no attribute {name!r}")
