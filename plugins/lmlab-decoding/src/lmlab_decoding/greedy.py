"""Greedy decoding: always take the most likely next token.

Deterministic and the best single-step choice, but prone to repetitive loops in open-ended text
(Holtzman et al. 2020, https://arxiv.org/abs/1904.09751). Ties go to the lowest token id.
"""

import torch

from lmlab.api import TokenDecoder, TokenRows


class GreedyDecoder(TokenDecoder):
    api = ">=1.21,<2"  # picks_most_likely; TokenDecoder (1.17)
    picks_most_likely = True  # lmlab serve accepts temperature 0 from clients
    def choose(self, logits: torch.Tensor, rows: TokenRows) -> torch.Tensor:
        return logits.argmax(dim=-1)  # (B,)
