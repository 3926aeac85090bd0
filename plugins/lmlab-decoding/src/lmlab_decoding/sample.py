"""Ancestral sampling with temperature, top-k and nucleus (top-p) truncation.

Each next token is drawn from softmax(logits / temperature): below 1 the distribution sharpens
towards greedy, above 1 it flattens, and 0 is greedy itself (OpenAI's meaning, so ``lmlab serve``
takes ``temperature: 0``). Truncation removes the unreliable tail before sampling: top-k keeps the
k most likely tokens (Fan et al. 2018, https://arxiv.org/abs/1805.04833); top-p keeps the smallest
set of most likely tokens whose probability reaches p, the nucleus (Holtzman et al. 2020,
https://arxiv.org/abs/1904.09751). With both, top-k applies first, as in nanoGPT and Hugging Face.
The kept tokens are renormalised by the softmax.

Every row of a step has its own temperature, top-k and top-p (``lmlab serve``: one request a row),
applied in one pass over the batch, after the repetition penalty and n-gram ban
(:mod:`lmlab_decoding.penalties`).
"""

import torch

from lmlab.api import Field, TokenDecoder, TokenRows
from lmlab_decoding.penalties import PenaltyOptions, penalize


class SampleOptions(PenaltyOptions):
    temperature: float = Field(1.0, ge=0, help="divides the logits; < 1 sharpens, > 1 flattens, 0 is greedy")
    top_k: int | None = Field(None, ge=1, help="sample among the k most likely tokens only (unset: all)")
    top_p: float | None = Field(None, ge=0, le=1, help="sample within the smallest set of mass >= top_p (unset: all; "
                                                       "0: the most likely token)")


def filter_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                top_p: torch.Tensor) -> torch.Tensor:
    """logits (B, V), per-row temperature (B,) > 0, top_k (B,) int64 (≥ V: all) and top_p (B,) (1: all)
    → the scaled logits with each row's tokens outside its top-k and its nucleus set to -inf."""
    logits = logits / temperature[:, None].to(logits.dtype)
    V = logits.shape[-1]
    cut_k = top_k < V
    if bool(cut_k.any()):
        k = top_k.clamp(max=V)
        largest = torch.topk(logits, int(k.max()), dim=-1).values  # (B, max k)
        kth = largest.gather(-1, (k - 1)[:, None])  # (B, 1); ties with the kth stay, as in nanoGPT
        kth = kth.masked_fill(~cut_k[:, None], float("-inf"))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    cut_p = top_p < 1
    if bool(cut_p.any()):
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # (B, V)
        probs = sorted_logits.softmax(dim=-1)
        # A token stays if the tokens ranked above it hold less than top_p: the most likely one
        # always stays, and the set stops at the first token that brings the mass to top_p.
        outside = probs.cumsum(dim=-1) - probs >= top_p[:, None].to(probs.dtype)
        outside[:, 0] = False
        outside &= cut_p[:, None]
        sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


def filter_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                  top_p: float | None = None) -> torch.Tensor:
    """logits (B, V) → the scaled logits with the tokens outside top-k / the nucleus set to -inf
    (one setting for every row)."""
    B, V = logits.shape
    full = lambda value, dtype: torch.full((B,), value, dtype=dtype, device=logits.device)  # noqa: E731
    return filter_rows(logits, full(temperature, torch.float32), full(V if top_k is None else top_k, torch.long),
                       full(1.0 if top_p is None else top_p, torch.float32))


class SamplingDecoder(TokenDecoder):
    api = ">=1.21,<2"  # TokenRows.history (the penalties); TokenDecoder (1.17)
    Options = SampleOptions

    def choose(self, logits: torch.Tensor, rows: TokenRows) -> torch.Tensor:
        return self._draw(penalize(logits, rows), rows)

    def _draw(self, logits: torch.Tensor, rows: TokenRows) -> torch.Tensor:
        temperature = rows.values("temperature")
        hot = temperature > 0
        if not bool(hot.all()):  # temperature 0: the most likely token, no draw
            chosen = logits.argmax(dim=-1)
            index = hot.nonzero().squeeze(1)
            if index.numel():
                chosen[index] = self._draw(logits.index_select(0, index), rows.select(index.tolist()))
            return chosen
        V = logits.shape[-1]
        probs = filter_rows(logits, temperature, rows.values("top_k", V, torch.long),
                            rows.values("top_p", 1.0)).softmax(dim=-1)  # (B, V)
        return rows.sample(probs)  # (B,)
