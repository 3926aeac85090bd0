"""The next token of every row of a step, each row with its own request's temperature and top-p.

OpenAI's semantics: temperature 0 is greedy (argmax); otherwise a token is drawn from
softmax(logits / temperature), restricted to the nucleus when top_p < 1: the smallest set of most
likely tokens whose probability reaches top_p (Holtzman et al. 2020,
https://arxiv.org/abs/1904.09751; the most likely token always stays, so top_p = 0 is greedy too).
One pass over the rows of a step: a (B,) temperature tensor and a (B,) top-p tensor, no loop.
"""

import torch


def choose(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """logits (B, V), temperature (B,) >= 0, top_p (B,) in [0, 1] → the chosen token ids (B,) int64."""
    chosen = logits.argmax(dim=-1)
    sampled = (temperature > 0).nonzero().squeeze(1)
    if sampled.numel() == 0:
        return chosen
    scaled = logits.index_select(0, sampled) / temperature.index_select(0, sampled)[:, None].to(logits.dtype)
    p = top_p.index_select(0, sampled)
    if bool((p < 1).any()):
        scaled = nucleus(scaled, p)
    probs = scaled.softmax(dim=-1)
    chosen[sampled] = torch.multinomial(probs, 1, generator=generator)[:, 0]
    return chosen


def nucleus(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits (B, V) with the tokens outside each row's nucleus set to -inf (rows with top_p = 1 keep all)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    # A token stays if the tokens ranked above it hold less than top_p: the set stops at the first
    # token that brings the mass to top_p.
    outside = probs.cumsum(dim=-1) - probs >= top_p[:, None]
    outside[:, 0] = False
    outside &= (top_p < 1)[:, None]
    sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
