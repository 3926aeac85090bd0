"""Greedy decoding: always take the most likely next token.

Deterministic and the best single-step choice, but prone to repetitive loops in open-ended text
(Holtzman et al. 2020, https://arxiv.org/abs/1904.09751). Ties go to the lowest token id.
"""

import torch

from lmlab.api import TokenDecoder, TokenRows


class GreedyDecoder(TokenDecoder):
    def choose(self, logits: torch.Tensor, rows: TokenRows) -> torch.Tensor:
        return logits.argmax(dim=-1)  # (B,)
