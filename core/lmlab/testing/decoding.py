"""Conformance checks of decoding plugins (``Decoder.generate``: a prompt of token ids → a continuation).

The model a decoder is checked with is the kit's reference language model (tiny, seeded, untrained),
seen through :class:`SteeredModel`: its logits are sharpened so the most likely token stands out, the
end-of-sequence id is steered (never likely, or certain at a chosen position of each row) and, like a
model with a learned position table, it refuses a context longer than ``block_size``, so a decoder
that feeds it a longer sequence instead of sliding its window (``lmlab.api.Stepper``) fails.

Greedy equivalence needs the plugin to decode greedily. A plugin without options (``greedy``) is
taken as it is; otherwise the kit sets the options that make the usual decoders greedy (``top_k`` 1,
any ``*beam*`` count 1). A plugin with another such setting says so with ``greedy={...}``
(``check_decoding(MyDecoder, greedy={"width": 1})``); one with none skips the check
(``skip=["greedy_equivalence"]``).
"""

import torch
from torch import nn

from lmlab.api import Decoder, InferenceCache, Options, TokenDecoder, TokenRows
from lmlab.testing import generic
from lmlab.testing.common import SAME, Subject, fail, run_checks, select_checks
from lmlab.testing.reference import ReferenceAttention, ReferenceFFN, ReferencePosition

PROMPT = 4  # tokens per prompt: room for 12 new ones in the default block of 16
SHARPEN = 30.0  # logits of an untrained model (std ~0.1) times this: std ~3, a clear most likely token
NEVER = -1e9  # a logit no temperature a decoder applies makes likely


class SteeredModel(nn.Module):
    """The reference model as ``lmlab.api.LanguageModel``, logits sharpened, the EOS id steered.

    ``sharpen`` 1 leaves the untrained model's nearly flat logits, under which a random draw shows.

    ``eos_at`` maps a prompt's first token to the position (in the whole row, prompt included) where
    that row must emit ``eos_id``: there every other logit is ``NEVER``; elsewhere ``eos_id``'s is. Rows
    are told apart by their first token because a decoder may reorder or repeat rows (beam search).
    """

    def __init__(self, model: nn.Module, eos_id: int | None = None, eos_at: dict[int, int] | None = None,
                 sharpen: float = SHARPEN):
        super().__init__()
        self.model, self.eos_id, self.eos_at, self.sharpen = model, eos_id, eos_at or {}, sharpen
        self.block_size, self.vocab_size = model.block_size, model.vocab_size

    @property
    def max_context(self) -> int:
        return self.block_size

    def new_cache(self, batch_size: int, max_len: int) -> InferenceCache:
        if max_len > self.max_context:
            raise ValueError(f"max_len {max_len} exceeds the model's context of {self.max_context}")
        return _RowCache(self.model.new_cache(batch_size, max_len))

    def forward(self, idx: torch.Tensor, cache: InferenceCache | None = None) -> torch.Tensor:
        start = cache.length if cache is not None else 0
        if start + idx.shape[1] > self.max_context:
            raise ValueError(f"positions up to {start + idx.shape[1] - 1} requested; this model covers "
                             f"0..{self.max_context - 1} (model.block_size); crop the context")
        if start == 0 and isinstance(cache, _RowCache):
            cache.first = idx[:, 0].clone()
        logits = self.model(idx, cache=cache) * self.sharpen  # (B, T, V)
        if self.eos_id is None:
            return logits
        first = cache.first if isinstance(cache, _RowCache) and start > 0 else idx[:, 0]
        logits[..., self.eos_id] = NEVER
        for token, position in self.eos_at.items():
            row = first == token                                                   # (B,)
            step = position - 1 - start  # the logits at position p - 1 choose the token at p
            if 0 <= step < idx.shape[1] and bool(row.any()):
                logits[row, step] = NEVER
                logits[row, step, self.eos_id] = 0.0
        return logits


class _RowCache(InferenceCache):
    """The reference model's cache, also holding each row's first token (the key of ``eos_at``)."""

    def __init__(self, inner: InferenceCache):
        super().__init__(inner.states, inner.max_len)
        self.first: torch.Tensor | None = None

    def reorder(self, index: torch.Tensor) -> None:
        super().reorder(index)
        if self.first is not None:
            self.first = self.first.index_select(0, index)


class DecodingSubject(Subject):
    slot = "decoding"

    def __init__(self, plugin, options: dict | Options | None = None, *, greedy: dict | None = None, **settings):
        super().__init__(plugin, options, **settings)
        self.greedy = greedy

    def decoder(self, options: Options | None = None) -> Decoder:
        return self.cls(options if options is not None else self.options)

    def greedy_options(self) -> Options:
        """The options under test with those that make the plugin greedy (see the module docstring)."""
        values = self.options.model_dump()
        if self.greedy is not None:
            values.update(self.greedy)
        else:
            for name, value in values.items():
                count = value is None or (isinstance(value, int) and not isinstance(value, bool))
                if name == "top_k" or ("beam" in name and count):
                    values[name] = 1
        return self.cls.Options(**values)

    def model(self, **steering) -> SteeredModel:
        from lmlab.model import LanguageModel

        with self.seeded(self.seed):
            # Untied: with the head tied to the embedding, an untrained model's likeliest next token is
            # the current one, and greedy text repeats a token (which a broken decoder could match).
            model = LanguageModel(self.shape, position=ReferencePosition(), attention=ReferenceAttention(),
                                  ffn=ReferenceFFN(), tie_embeddings=False)
        return SteeredModel(model, **steering).to(self.device).eval()

    def prompts(self, rows: int, seed: int) -> torch.Tensor:
        """(rows, PROMPT) token ids below vocab_size - 1 (the id the checks use as EOS), each row starting
        with a different token (rows are keyed by it)."""
        prompt = self.randint(self.shape.vocab_size - 1, rows, PROMPT, seed=seed)
        prompt[:, 0] = torch.arange(rows, device=self.device) + 1
        return prompt

    def generate(self, decoder: Decoder, model: SteeredModel, prompt: torch.Tensor, max_new_tokens: int,
                 eos_id: int | None = None, seed: int | None = None, global_seed: int = 0) -> torch.Tensor:
        """``decoder.generate`` under no_grad with a generator seeded by ``seed``, and torch's global random
        state seeded by ``global_seed`` (the caller's restored afterwards, whatever the decoder draws)."""
        generator = torch.Generator(device=self.device).manual_seed(self.seed if seed is None else seed)
        with torch.no_grad(), self.seeded(global_seed):
            out = decoder.generate(model, prompt, max_new_tokens, eos_id=eos_id, generator=generator)
        if not isinstance(out, torch.Tensor) or out.dim() != 2 or out.shape[0] != prompt.shape[0]:
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            fail(f"generate(prompt {tuple(prompt.shape)}, max_new_tokens={max_new_tokens}) returned {got}, "
                 f"not a ({prompt.shape[0]}, T + n) tensor")
        return out

    def deterministic(self, options: Options) -> bool:
        """Whether two generator seeds give the same continuations at ``options`` (over flat logits)."""
        decoder, model, prompt = self.decoder(options), self.model(sharpen=1.0), self.prompts(3, self.seed + 1)
        n = self.shape.block_size - PROMPT
        return torch.equal(self.generate(decoder, model, prompt, n, seed=1),
                           self.generate(decoder, model, prompt, n, seed=2))


def max_new_tokens(subject: DecodingSubject) -> None:
    """With ``eos_id`` None, and again with an ``eos_id`` the model never emits, ``generate`` returns
    exactly (B, T + max_new_tokens) for max_new_tokens 0, 1 and block_size + 3 (past the model's
    context, which the model refuses to attend over: the decoder must slide its window), in the prompt's
    dtype, beginning with the prompt, every new id in [0, vocab_size); the prompt tensor is left as it was."""
    decoder, V = subject.decoder(), subject.shape.vocab_size
    for eos_id in (None, V - 1):
        model = subject.model(eos_id=eos_id)
        for n in (0, 1, subject.shape.block_size + 3):
            prompt = subject.prompts(2, subject.seed + n)
            given = prompt.clone()
            out = subject.generate(decoder, model, prompt, n, eos_id=eos_id)
            what = f"generate(prompt (2, {PROMPT}), max_new_tokens={n}, eos_id={eos_id})"
            if not torch.equal(prompt, given):
                fail(f"{what} changed the prompt tensor in place")
            if tuple(out.shape) != (2, PROMPT + n):
                fail(f"{what} returned shape {tuple(out.shape)}, expected {(2, PROMPT + n)}: with no end-of-sequence "
                     "token emitted, exactly max_new_tokens new tokens")
            if out.dtype != prompt.dtype:
                fail(f"{what} returned dtype {out.dtype}, not the prompt's {prompt.dtype}")
            if not torch.equal(out[:, :PROMPT], prompt):
                fail(f"{what}: the output does not begin with the prompt")
            new = out[:, PROMPT:]
            if new.numel() and (int(new.min()) < 0 or int(new.max()) >= V):
                fail(f"{what}: new token ids outside [0, {V}): {new.tolist()}")


def greedy_equivalence(subject: DecodingSubject) -> None:
    """At the greedy options (the module docstring says which), two generator seeds give the same
    continuations, and each new token of each row is the argmax of the model's logits over the row up
    to it, computed by a full forward without a cache (a token whose logit is within 1e-4 of the
    logits' scale of the largest counts: cached and full forwards round differently)."""
    options = subject.greedy_options()
    shown = {k: v for k, v in options.model_dump().items() if v != subject.options.model_dump().get(k)}
    at = f"at options {options.model_dump()}" + (f" (greedy: {shown})" if shown else "")
    if not subject.deterministic(options):
        fail(f"{at}, two generator seeds give different continuations, so the kit cannot compare it with greedy "
             "decoding: pass greedy={...}, the options under which the plugin decodes greedily, or "
             "skip=['greedy_equivalence'] if it has none")
    model, prompt = subject.model(), subject.prompts(3, subject.seed + 2)
    n = subject.shape.block_size - PROMPT
    out = subject.generate(subject.decoder(options), model, prompt, n)
    if out.shape[1] != PROMPT + n:
        fail(f"{at}, generate returned {out.shape[1] - PROMPT} new tokens, expected {n} (no eos_id given)")
    with torch.no_grad():
        logits = model(out[:, :-1])  # (B, T + n - 1, V): position t - 1 scores token t
    for t in range(PROMPT, PROMPT + n):
        scores = logits[:, t - 1]                                                  # (B, V)
        best, chosen = scores.max(dim=-1).values, scores.gather(1, out[:, t:t + 1])[:, 0]
        short = (best - chosen) > SAME * scores.abs().max().item()
        if bool(short.any()):
            r = int(short.nonzero()[0])
            fail(f"{at}, row {r}'s new token {t - PROMPT} (position {t}) is {int(out[r, t])}, with logit "
                 f"{chosen[r].item():.4g}, but token {int(scores[r].argmax())} has the largest, "
                 f"{best[r].item():.4g}: not the greedy choice over the prefix")


def batch_independence(subject: DecodingSubject) -> None:
    """Each row of a batch (three prompts, the first repeated as the fourth) continues as that prompt
    alone does: at the plugin's options when two generator seeds give it the same continuations there,
    else at its greedy options (a random draw may legitimately depend on the batch). A plugin random
    at both is left to ``greedy_equivalence``, which fails for it."""
    options = subject.options
    if not subject.deterministic(options):
        options = subject.greedy_options()
        if not subject.deterministic(options):
            return
    decoder, model = subject.decoder(options), subject.model()
    prompt = subject.prompts(3, subject.seed + 3)
    prompt = torch.cat([prompt, prompt[:1]])
    n = subject.shape.block_size - PROMPT
    batch = subject.generate(decoder, model, prompt, n)
    for r in range(len(prompt)):
        alone = subject.generate(decoder, model, prompt[r:r + 1], n)
        if not torch.equal(batch[r:r + 1, :alone.shape[1]], alone) or batch.shape[1] != alone.shape[1]:
            fail(f"at options {options.model_dump()}, row {r} of a batch of {len(prompt)} prompts continues "
                 f"{batch[r, PROMPT:].tolist()}, but the same prompt alone continues {alone[0, PROMPT:].tolist()}")


def per_row_options(subject: DecodingSubject) -> None:
    """A ``TokenDecoder`` (API 1.17) chooses each row with that row's options and generator, as
    ``lmlab serve`` batches requests that set their own: in one ``choose`` over rows alternating the
    options under test and the greedy ones, the greedy rows take the argmax, and every row chooses what
    it chooses alone with a generator seeded alike (a decoder reading ``self.options``, or drawing
    every row from one generator, fails). Other decoders are not checked."""
    decoder = subject.decoder()
    greedy = subject.greedy_options()
    if not isinstance(decoder, TokenDecoder) or not subject.deterministic(greedy):
        return  # greedy_equivalence reports a plugin random at its greedy options
    B, V = 6, subject.shape.vocab_size
    logits = subject.randn(B, V, seed=subject.seed + 4)  # flat enough that a draw shows
    options = [subject.options, greedy] * (B // 2)

    def generator(i: int) -> torch.Generator:
        return torch.Generator(device=subject.device).manual_seed(subject.seed + 10 + i)

    with torch.no_grad():
        together = decoder.choose(logits, TokenRows(options, [generator(i) for i in range(B)], subject.device))
        alone = [int(decoder.choose(logits[i:i + 1], TokenRows([options[i]], [generator(i)], subject.device))[0])
                 for i in range(B)]
    if together.tolist() != alone:
        fail(f"choose over {B} rows, each with its own options and generator, gave {together.tolist()}, but each row "
             f"alone gives {alone}: read every option through rows.values and draw through rows.sample")
    argmax = logits.argmax(dim=-1).tolist()
    wrong = [i for i in range(1, B, 2) if alone[i] != argmax[i]]
    if wrong:
        fail(f"rows {wrong} of a step carry the greedy options {greedy.model_dump()} but did not choose the argmax: "
             "choose must read each row's options from rows (rows.values), not self.options")


def eos(subject: DecodingSubject) -> None:
    """With a model whose logits make each row emit ``eos_id`` at one step (rows at new tokens 2, 5
    and 0) and never before: generation stops once every row has emitted it (T + 6 columns), each
    row's first ``eos_id`` is at its step and a row that finished holds only ``eos_id`` after it (as
    ``lmlab.api.Stepper`` decoders pad); with a fourth row that never emits it, all max_new_tokens (10)
    are generated. At the plugin's options, which the steering leaves no choice at those steps."""
    steps = [2, 5, 0]
    eos_id = subject.shape.vocab_size - 1
    decoder = subject.decoder()
    for rows, expected in ((3, PROMPT + max(steps) + 1), (4, PROMPT + 10)):
        prompt = subject.prompts(rows, subject.seed + 4)
        model = subject.model(eos_id=eos_id, eos_at={int(prompt[r, 0]): PROMPT + k for r, k in enumerate(steps)})
        out = subject.generate(decoder, model, prompt, 10, eos_id=eos_id)
        what = f"with eos_id {eos_id} forced at new tokens {steps[:rows]} of rows 0..{len(steps) - 1}" + (
            ", never in row 3" if rows > len(steps) else "")
        if out.shape[1] != expected:
            fail(f"{what}, max_new_tokens 10: the output has {out.shape[1] - PROMPT} new tokens, expected "
                 f"{expected - PROMPT}" + (" (generation stops once every row has emitted eos_id)"
                                           if rows == len(steps) else ""))
        for r, k in enumerate(steps):
            new = out[r, PROMPT:].tolist()
            if eos_id not in new or new.index(eos_id) != k or any(t != eos_id for t in new[k:]):
                fail(f"{what}: row {r} continues {new}; expected eos_id first at new token {k}, and only eos_id "
                     "after it")


def determinism(subject: DecodingSubject) -> None:
    """Two calls with generators seeded alike give the same tokens, even when torch's global random
    state differs between them: randomness comes from the ``generator`` argument alone (``lmlab
    generate`` seeds it), at the plugin's options, over the untrained model's flat logits (so a draw shows)."""
    decoder, model, prompt = subject.decoder(), subject.model(sharpen=1.0), subject.prompts(3, subject.seed + 5)
    n = subject.shape.block_size - PROMPT
    outs = [subject.generate(decoder, model, prompt, n, seed=7, global_seed=g) for g in (1, 2)]
    if not torch.equal(*outs):
        fail(f"with one generator seed, two calls continued {outs[0][0, PROMPT:].tolist()} and "
             f"{outs[1][0, PROMPT:].tolist()} (row 0) after torch.manual_seed(1) and (2): the decoder draws from "
             "torch's global random state instead of the generator it is given")


def global_rng(subject: DecodingSubject) -> None:
    """``generate`` with a generator leaves torch's global random state (and, on a CUDA device, the
    device's) as it found it: a caller's own random stream is not shifted by decoding."""
    decoder, model, prompt = subject.decoder(), subject.model(), subject.prompts(3, subject.seed + 6)
    generator = torch.Generator(device=subject.device).manual_seed(subject.seed)
    with torch.no_grad(), subject.seeded(subject.seed):
        before = _rng_states(subject.device)
        decoder.generate(model, prompt, subject.shape.block_size - PROMPT, generator=generator)
        if not all(torch.equal(a, b) for a, b in zip(before, _rng_states(subject.device))):
            fail("generate, given a generator, changed torch's global random state (it drew from torch's default "
                 "generator: pass generator= to torch.multinomial, torch.rand, ...)")


def _rng_states(device: torch.device) -> list[torch.Tensor]:
    return [torch.get_rng_state()] + ([torch.cuda.get_rng_state(device)] if device.type == "cuda" else [])


#: name → check, in the order ``check_decoding`` runs them.
CHECKS = {
    "plugin_class": generic.plugin_class,
    "max_new_tokens": max_new_tokens,
    "greedy_equivalence": greedy_equivalence,
    "batch_independence": batch_independence,
    "per_row_options": per_row_options,
    "eos": eos,
    "determinism": determinism,
    "global_rng": global_rng,
}


def check_decoding(plugin, options=None, **settings) -> None:
    """Run every decoding check on ``plugin``; raise one ConformanceError listing the failures.

    Settings: those of every entry point (``shape``, ``seed``, ``device``, ``skip``) and ``greedy``,
    the options under which the plugin decodes greedily (see the module docstring)."""
    skip = settings.pop("skip", ())
    run_checks(select_checks(CHECKS, DecodingSubject(plugin, options, **settings), skip))
