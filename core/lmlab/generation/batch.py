"""Running a decoder over a batch of prompts as streamed text, and as an objective's rollouts (token
ids cut at stop ids); the plain token-id loop is lmlab.generation.token_ids.

Plugins are resolved once, before the loop: the decoder drives the engine, and the engine calls the
model; nothing is looked up per token.
"""

import time
from dataclasses import dataclass
from typing import Callable

import torch

from lmlab.generation.engine import make_engine
from lmlab.generation.outputs import Outputs
from lmlab.generation.token_ids import run_decoder


@torch.inference_mode()
def generate_ids(decoder, model, prompts: list[list[int]], max_new_tokens: int, *, stop_ids=(),
                 generator: torch.Generator | None = None, eos_id: int | None = None) -> list[list[int]]:
    """What ``ObjectiveContext.generate`` does (an objective's rollouts): the new tokens of each prompt
    (any lengths) from ``decoder``, each cut after the first of ``stop_ids`` or at ``eos_id``, with the
    model in eval mode for the call."""
    if decoder.needs_runs:
        raise ValueError(f"decoder {decoder.name!r} loads other runs, which an objective's rollouts do not provide")
    if not prompts:
        return []
    decoder.prepare(model, {})
    longest = max(len(p) for p in prompts) + max_new_tokens
    engine = make_engine(model, len(prompts) * decoder.rows_per_prompt(), longest)
    outputs = Outputs(None, [max_new_tokens] * len(prompts), eos_id=eos_id)
    stops = set(stop_ids)
    was_training = model.training
    model.eval()
    try:
        for _ in run_decoder(decoder, engine, [[int(t) for t in p] for p in prompts], outputs, generator):
            pass
    finally:
        model.train(was_training)
    made = []
    for c in outputs.completions:
        tokens = list(c.tokens) + ([eos_id] if c.finish_reason == "stop" and eos_id is not None else [])
        cut = next((i for i, t in enumerate(tokens) if t in stops), None)
        made.append(tokens if cut is None else tokens[:cut + 1])
    return made


@dataclass
class Generation:
    outputs: Outputs
    seconds: float
    tokens: int  # tokens made, over every prompt
    note: str | None = None  # what the engine says of how it decoded (Engine.report, API 1.19), if anything

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@torch.inference_mode()
def generate_texts(model, tokenizer, decoder, prompts: list[str], max_new_tokens: int, *, stop: list[str] = (),
                   seed: int = 0, cache: str = "contiguous", block_size: int = 16, cuda_graph: bool = False,
                   compile: bool = False,
                   on_text: Callable[[int, str], None] | None = None) -> Generation:
    """Continue every prompt; ``on_text(i, text)`` receives prompt i's text as it becomes final."""
    encoded = [list(tokenizer.encode(p)) or [tokenizer.eos_id or 0] for p in prompts]
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    longest = max(len(ids) for ids in encoded) + max_new_tokens
    engine = make_engine(model, len(prompts) * decoder.rows_per_prompt(), longest, cache=cache,
                         block_size=block_size, cuda_graph=cuda_graph, compile=compile)
    outputs = Outputs(tokenizer, [max_new_tokens] * len(prompts), stop=[list(stop)] * len(prompts),
                      eos_id=tokenizer.eos_id)
    was_training = model.training
    model.eval()
    started = time.perf_counter()
    try:
        for touched in run_decoder(decoder, engine, encoded, outputs, generator):
            if on_text is not None:
                for i in touched:
                    if text := outputs.delta(i):
                        on_text(i, text)
        if on_text is not None:
            for i in range(len(prompts)):
                if text := outputs.delta(i):
                    on_text(i, text)
    finally:
        model.train(was_training)
    # A compiled step's first call compiles it: reported by the engine, not counted as decoding time.
    seconds = time.perf_counter() - started - getattr(engine, "compile_s", 0.0)
    report = getattr(engine, "report", None)  # optional in the Engine protocol
    return Generation(outputs, seconds, sum(len(c.tokens) for c in outputs.completions),
                      report() if report is not None else None)
