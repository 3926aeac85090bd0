"""The loop shared by decoders that pick one token per step from the next-token logits.

The model is fed through ``lmlab.api.Stepper``: the prompt once, then one token per step against
its inference cache (KV cache), with a sliding window once the text outgrows the model's context.
All rows of the batch advance together; a row that has emitted ``eos_id`` is finished and is
padded with ``eos_id`` until every row is finished or ``max_new_tokens`` is reached.
"""

import torch

from lmlab.api import Decoder, LanguageModel, Stepper


class StepwiseDecoder(Decoder):
    """Subclasses say how to choose the next token; this class runs the loop."""

    def choose(self, logits: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """logits (B, V) float32 → next token ids (B,)."""
        raise NotImplementedError

    def generate(self, model: LanguageModel, prompt: torch.Tensor, max_new_tokens: int,
                 eos_id: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        B, T = prompt.shape
        if max_new_tokens <= 0:
            return prompt
        stepper = Stepper(model, B, T + max_new_tokens)
        logits = stepper.start(prompt)  # (B, V)
        finished = torch.zeros(B, dtype=torch.bool, device=prompt.device)
        new = []
        for i in range(max_new_tokens):
            token = self.choose(logits.float(), generator)  # (B,)
            if eos_id is not None:
                token = token.masked_fill(finished, eos_id)
                finished |= token == eos_id
            new.append(token)
            if i == max_new_tokens - 1 or (eos_id is not None and bool(finished.all())):
                break  # no logits needed after the last token
            logits = stepper.step(token)
        return torch.cat([prompt, torch.stack(new, dim=1).to(prompt.dtype)], dim=1)  # (B, T + n)
