"""Ancestral sampling with temperature, top-k and nucleus (top-p) truncation.

Each next token is drawn from softmax(logits / temperature): below 1 the distribution sharpens
towards greedy, above 1 it flattens. Truncation removes the unreliable tail before sampling:
top-k keeps the k most likely tokens (Fan et al. 2018, https://arxiv.org/abs/1805.04833); top-p
keeps the smallest set of most likely tokens whose probability reaches p, the nucleus (Holtzman et
al. 2020, https://arxiv.org/abs/1904.09751). With both, top-k applies first, as in nanoGPT and
Hugging Face. The kept tokens are renormalised by the softmax.
"""

import torch

from lmlab.api import DecodingOptions, Field
from lmlab_decoding.stepwise import StepwiseDecoder


class SampleOptions(DecodingOptions):
    temperature: float = Field(1.0, gt=0, help="divides the logits; < 1 sharpens, > 1 flattens")
    top_k: int | None = Field(None, ge=1, help="sample among the k most likely tokens only (unset: all)")
    top_p: float | None = Field(None, gt=0, le=1, help="sample within the smallest set of mass >= top_p (unset: all)")


def filter_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                  top_p: float | None = None) -> torch.Tensor:
    """logits (B, V) → the scaled logits with the tokens outside top-k / the nucleus set to -inf."""
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # (B, V)
        probs = sorted_logits.softmax(dim=-1)
        # A token stays if the tokens ranked above it hold less than top_p: the most likely one
        # always stays, and the set stops at the first token that brings the mass to top_p.
        outside = probs.cumsum(dim=-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


class SamplingDecoder(StepwiseDecoder):
    Options = SampleOptions

    def choose(self, logits: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        o = self.options
        probs = filter_logits(logits, o.temperature, o.top_k, o.top_p).softmax(dim=-1)  # (B, V)
        return torch.multinomial(probs, 1, generator=generator)[:, 0]  # (B,)
