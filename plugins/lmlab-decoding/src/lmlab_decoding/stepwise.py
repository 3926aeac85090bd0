"""The loop shared by decoders that pick one token per step from the next-token logits.

Every prompt gets a row of the engine (``lmlab.api.Engine``): the prompts are fed once, then each
step feeds one token per unfinished row and picks the next from its logits. Rows advance together
whatever their lengths; a prompt that is finished (EOS, a stop string, its token limit) leaves the
batch and its row is released at once, so the others' steps get cheaper.
"""

from typing import Iterator

import torch

from lmlab.api import Decoder, Engine, Outputs


class StepwiseDecoder(Decoder):
    """Subclasses say how to choose the next token; this class runs the loop."""

    api = ">=1.8,<2"  # Decoder.decode over an Engine

    def choose(self, logits: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """logits (B, V) float32 → next token ids (B,)."""
        raise NotImplementedError

    def decode(self, engine: Engine, prompts: list[list[int]], outputs: Outputs,
               generator: torch.Generator | None = None) -> Iterator[dict[int, list[int]]]:
        rows, logits = engine.add(prompts)
        live = list(range(len(prompts)))  # prompt indices, in the order of logits' rows
        while True:
            tokens = self.choose(logits, generator)  # (B,)
            yield {i: [t] for i, t in zip(live, tokens.tolist())}
            keep = [j for j, i in enumerate(live) if not outputs.done(i)]
            if len(keep) < len(live):
                engine.release([rows[i] for j, i in enumerate(live) if outputs.done(i)])
                if not keep:
                    return
                live = [live[j] for j in keep]
                tokens = tokens[torch.tensor(keep, device=tokens.device)]
            logits = engine.step([rows[i] for i in live], tokens[:, None])[:, -1]
