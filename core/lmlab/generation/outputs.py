"""Each prompt's tokens and text as a decoder makes them: limits, stop strings, streamed deltas.

A prompt is finished at the tokenizer's end-of-text id (not part of the text), at the first stop
string (cut out, with everything after it), or after its most new tokens. Streamed text never shows
a stop string, even one split over several tokens: a tail that could still become one is held back
until it cannot, as the OpenAI API streams. Text is decoded from all of a prompt's tokens at once,
so a tokenizer whose pieces join differently in context (sentencepiece's leading spaces, bytes of
one UTF-8 character split over tokens) streams exactly the final text.
"""

from dataclasses import dataclass, field
from enum import StrEnum, auto


class Finish(StrEnum):
    """Why a prompt's completion ended, spelt as OpenAI's ``finish_reason``: a member is that string,
    so it goes into JSON and compares with it as it is."""

    STOP = auto()  # the tokenizer's EOS or a stop string
    LENGTH = auto()  # its most new tokens, or the end of the context


@dataclass
class Completion:
    tokens: list[int] = field(default_factory=list)
    text: str = ""  # the final text so far (cut at a stop string)
    sent: int = 0  # characters of text already streamed
    finish_reason: Finish | None = None
    candidates: list[tuple[list[int], float]] = field(default_factory=list)


class Outputs:
    """``lmlab.api.Outputs`` for ``n`` prompts."""

    def __init__(self, tokenizer, max_new_tokens: list[int], stop: list[list[str]] | None = None,
                 eos_id: int | None = None, limits: list[int] | None = None):
        self.tokenizer = tokenizer
        self.eos_id = eos_id
        self.limits = list(max_new_tokens)
        self.stops = stop or [[] for _ in max_new_tokens]
        # Whether to decode text as tokens come: only stop strings need it before the end.
        self.completions = [Completion() for _ in max_new_tokens]
        self.capped = [False] * len(max_new_tokens)
        if limits is not None:  # the context allows fewer than asked: a "length" finish either way
            for i, cap in enumerate(limits):
                if cap < self.limits[i]:
                    self.limits[i], self.capped[i] = max(cap, 0), True

    def __len__(self) -> int:
        return len(self.completions)

    # -- lmlab.api.Outputs ------------------------------------------------------------------------

    def max_new_tokens(self, i: int) -> int:
        return self.limits[i]

    def done(self, i: int) -> bool:
        return self.completions[i].finish_reason is not None

    def ends(self, i: int, tokens: list[int]) -> bool:
        if len(tokens) >= self.limits[i] or (self.eos_id is not None and self.eos_id in tokens):
            return True
        return bool(self.stops[i]) and self._cut(i, self._decode(tokens))[1]

    def offer(self, i: int, candidates: list[tuple[list[int], float]]) -> None:
        self.completions[i].candidates = [(list(t), float(s)) for t, s in candidates]

    # -- the core's side ----------------------------------------------------------------------------

    def candidate_texts(self, i: int) -> list[tuple[str, float]]:
        """Prompt i's candidates (a beam search's) as text, each ending where its completion would: at
        the end-of-text token or cut at a stop string, with its score."""
        out = []
        for tokens, score in self.completions[i].candidates:
            if self.eos_id is not None and self.eos_id in tokens:
                tokens = tokens[:tokens.index(self.eos_id)]
            out.append((self._cut(i, self._decode(tokens))[0], score))
        return out

    def record(self, i: int, tokens: list[int]) -> None:
        """Tokens a decoder yielded for prompt i; those past its end are dropped."""
        c = self.completions[i]
        if c.finish_reason is not None:
            return
        before = len(c.tokens)
        for token in tokens:
            if self.eos_id is not None and token == self.eos_id:
                c.finish_reason = Finish.STOP
                break
            c.tokens.append(token)
            if len(c.tokens) >= self.limits[i]:
                c.finish_reason = Finish.LENGTH
                break
        if self.stops[i]:
            c.text, stopped = self._cut(i, self._decode(c.tokens))
            if stopped:
                c.finish_reason = Finish.STOP
                # A decoder that yields several tokens at once (speculative) may pass the stop string:
                # keep the tokens up to the one that completed it, as one token at a time would.
                for n in range(before + 1, len(c.tokens)):
                    if self._cut(i, self._decode(c.tokens[:n]))[1]:
                        del c.tokens[n:]
                        break
        elif c.finish_reason is not None:
            c.text = self._decode(c.tokens)

    def delta(self, i: int) -> str:
        """Text of prompt i not streamed yet that is final: nothing a later token could still change."""
        c = self.completions[i]
        if c.finish_reason is None:
            text = c.text if self.stops[i] else self._decode(c.tokens)
            safe = len(text) - self._held_back(i, text)
        else:
            text = c.text
            safe = len(text)
        out = text[c.sent:safe]
        c.sent = max(c.sent, safe)
        return out

    def finish(self, i: int) -> None:
        """The decoder stopped without a reason for prompt i (its limit, or the context): "length"."""
        c = self.completions[i]
        if c.finish_reason is None:
            c.finish_reason = Finish.LENGTH
            c.text = self._cut(i, self._decode(c.tokens))[0] if self.stops[i] else self._decode(c.tokens)

    def _decode(self, tokens: list[int]) -> str:
        return text_of(self.tokenizer, tokens) if tokens and self.tokenizer is not None else ""


    def _cut(self, i: int, text: str) -> tuple[str, bool]:
        cuts = [text.find(s) for s in self.stops[i]]
        cuts = [c for c in cuts if c >= 0]
        return (text[:min(cuts)], True) if cuts else (text, False)

    def _held_back(self, i: int, text: str) -> int:
        """Characters at the end that may still change: an incomplete UTF-8 character, or a prefix of a stop string."""
        hold = 1 if text.endswith("\ufffd") else 0
        for s in self.stops[i]:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        return hold


def text_of(tokenizer, tokens: list[int]) -> str:
    """The text of generated ids. Ids past the tokenizer's vocabulary are an objective's special tokens
    (a mask, T5's sentinels): they have no text, and the tokenizer cannot decode them."""
    size = getattr(tokenizer, "vocab_size", None)
    return tokenizer.decode(tokens if size is None else [t for t in tokens if t < size])
