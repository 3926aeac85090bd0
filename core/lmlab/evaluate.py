"""Held-out exact match for instruction data: greedy answers to each record's prompt, compared whole.

A record's prompt is its leading unscored segments (the instruction and input, formatted by the data
plugin's template, exactly as in training); the reference is the scored rest. The model answers by
greedy decoding — the usual protocol for exact match (e.g. the SQuAD and GSM8K evaluations of LM
papers) — until it produces the stop text (a newline: answers here are one line), the tokenizer's
end-of-document token, or as many tokens as the longest reference plus a margin. An answer counts
when it equals the reference after stripping surrounding whitespace.

Prompts of equal token length are decoded together in one batch through the KV cache (no padding,
so no attention mask is needed), which on a character model makes a few thousand answers take
seconds rather than minutes.
"""

from collections import defaultdict
from dataclasses import dataclass

import torch

from lmlab.api import Record, UserError
from lmlab.api.decoding import Stepper
from lmlab.generation.outputs import text_of

MARGIN = 8  # tokens past the longest reference, so an over-long answer shows as one


@dataclass
class Answer:
    prompt: str
    reference: str
    answer: str

    @property
    def correct(self) -> bool:
        return self.answer.strip() == self.reference.strip()


def split_record(record: Record) -> tuple[str, str]:
    """(prompt, reference): the leading unscored segments, then everything after them."""
    segments = list(record.segments)
    cut = next((i for i, s in enumerate(segments) if s.scored), len(segments))
    return "".join(s.text for s in segments[:cut]), "".join(s.text for s in segments[cut:])


@torch.no_grad()
def answer_all(model, tokenizer, records: list[Record], stop: str = "\n", batch_size: int = 64) -> list[Answer]:
    """Greedy answers to every record's prompt, in the records' order."""
    pairs = [split_record(r) for r in records]
    encoded = [list(tokenizer.encode(prompt)) for prompt, _ in pairs]
    max_new = max((_length(tokenizer, ref) for _, ref in pairs), default=0) + MARGIN
    by_length = defaultdict(list)
    for i, ids in enumerate(encoded):
        by_length[len(ids)].append(i)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    texts: dict[int, str] = {}
    try:
        for length, indices in sorted(by_length.items()):
            for start in range(0, len(indices), batch_size):
                chunk = indices[start:start + batch_size]
                prompt = torch.tensor([encoded[i] for i in chunk], dtype=torch.long, device=device)
                for i, text in zip(chunk, _greedy(model, tokenizer, prompt, max_new, stop)):
                    texts[i] = text
    finally:
        model.train(was_training)
    return [Answer(prompt, ref, texts[i]) for i, (prompt, ref) in enumerate(pairs)]


def _length(tokenizer, text: str) -> int:
    try:
        return len(tokenizer.encode(text))
    except UserError:  # a reference with characters the model cannot produce: it is simply wrong
        return len(text.encode())


class _EngineStepper:
    """Stepper's start/step over the generation engine, for a model that supplies its own engine
    (``make_engine``: an encoder-decoder, whose prompt goes through the encoder and whose decoder
    continues from its start id)."""

    def __init__(self, model, batch_size: int, max_len: int):
        from lmlab.generation.engine import make_engine

        self.engine = make_engine(model, batch_size, max_len)
        self.rows: list[int] = []

    def start(self, prompt: torch.Tensor) -> torch.Tensor:
        self.rows, logits = self.engine.add(prompt.tolist())
        return logits

    def step(self, token: torch.Tensor) -> torch.Tensor:
        return self.engine.step(self.rows, token[:, None])[:, -1]


def _greedy(model, tokenizer, prompt: torch.Tensor, max_new: int, stop: str) -> list[str]:
    stepping = _EngineStepper if hasattr(model, "make_engine") else Stepper
    stepper = stepping(model, prompt.shape[0], prompt.shape[1] + max_new)
    logits = stepper.start(prompt)
    out = []
    done = torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)
    # Rows end early at a stop that is one token; a longer stop text is cut out after decoding.
    stop_ids = set()
    if stop and _length(tokenizer, stop) == 1:
        stop_ids = set(tokenizer.encode(stop))
    if tokenizer.eos_id is not None:
        stop_ids.add(tokenizer.eos_id)
    stops = torch.tensor(sorted(stop_ids) or [-1], dtype=torch.long, device=prompt.device)
    for step in range(max_new):
        token = logits.argmax(dim=-1)  # (B,)
        out.append(token)
        done |= torch.isin(token, stops)
        if bool(done.all()) or step == max_new - 1:
            break
        logits = stepper.step(token)
    generated = torch.stack(out, dim=1).tolist()
    texts = []
    for ids in generated:
        if tokenizer.eos_id is not None and tokenizer.eos_id in ids:
            ids = ids[:ids.index(tokenizer.eos_id)]
        text = text_of(tokenizer, ids)
        texts.append(text.split(stop, 1)[0] if stop else text)
    return texts


def exact_match(answers: list[Answer]) -> float:
    return sum(a.correct for a in answers) / max(len(answers), 1)
