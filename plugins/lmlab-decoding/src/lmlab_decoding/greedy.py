"""Greedy decoding: always take the most likely next token.

Deterministic and the best single-step choice, but prone to repetitive loops in open-ended text
(Holtzman et al. 2020, https://arxiv.org/abs/1904.09751), which ``repetition_penalty`` and
``no_repeat_ngram_size`` counter (:mod:`lmlab_decoding.penalties`). Ties go to the lowest token id.
"""

import torch

from lmlab.api import TokenDecoder, TokenRows
from lmlab_decoding.penalties import PenaltyOptions, penalize


class GreedyDecoder(TokenDecoder):
    api = ">=1.21,<2"  # picks_most_likely, TokenRows.history (the penalties); TokenDecoder (1.17)
    Options = PenaltyOptions
    picks_most_likely = True  # lmlab serve accepts temperature 0 from clients

    def choose(self, logits: torch.Tensor, rows: TokenRows) -> torch.Tensor:
        return penalize(logits, rows).argmax(dim=-1)  # (B,)
