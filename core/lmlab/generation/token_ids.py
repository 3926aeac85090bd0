"""A decoder run to the end over token ids: what ``Decoder.generate``'s default and every loop over
``decode`` share. Kept apart from the text-level loop (lmlab.generation.batch), which wraps decoders
in early exit, so that ``lmlab.api.decoding`` can use it without importing what imports the API."""

from typing import Iterator

import torch

from lmlab.generation.engine import make_engine
from lmlab.generation.outputs import Outputs


def run_decoder(decoder, engine, prompts: list[list[int]], outputs: Outputs,
                generator: torch.Generator | None = None) -> Iterator[list[int]]:
    """Drive ``decoder.decode``, recording what it yields; yields the prompt indices that got tokens."""
    for made in decoder.decode(engine, prompts, outputs, generator):
        for i, tokens in made.items():
            outputs.record(i, tokens)
        yield list(made)
    for i in range(len(outputs)):
        outputs.finish(i)


@torch.inference_mode()  # no autograd bookkeeping at all: a decode step is many small operations
def generate_tensor(decoder, model, prompt: torch.Tensor, max_new_tokens: int, eos_id: int | None = None,
                    generator: torch.Generator | None = None) -> torch.Tensor:
    """``Decoder.generate``'s default: prompt (B, T) → (B, T + n), rows that ended early padded with eos_id."""
    B, T = prompt.shape
    if max_new_tokens <= 0:
        return prompt
    engine = make_engine(model, B * decoder.rows_per_prompt(), T + max_new_tokens)
    outputs = Outputs(None, [max_new_tokens] * B, eos_id=eos_id)
    for _ in run_decoder(decoder, engine, prompt.tolist(), outputs, generator):
        pass
    rows = []
    for c in outputs.completions:
        rows.append(c.tokens + ([eos_id] if c.finish_reason == "stop" and eos_id is not None else []))
    n = max(len(r) for r in rows)
    pad = eos_id if eos_id is not None else 0
    new = torch.tensor([r + [pad] * (n - len(r)) for r in rows], dtype=prompt.dtype, device=prompt.device)
    return torch.cat([prompt, new.view(B, n)], dim=1)
