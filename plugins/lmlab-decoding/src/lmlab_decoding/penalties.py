"""Penalties that look back at a row's tokens, as Hugging Face transformers defines them, for the
token-level decoders (``greedy``, ``sample``):

- ``repetition_penalty`` (Keskar et al. 2019, CTRL): the logit of every token already in the row
  (prompt included) is divided by the penalty when positive and multiplied by it when negative, so
  above 1 a token seen before becomes less likely (transformers' ``RepetitionPenaltyLogitsProcessor``);
- ``no_repeat_ngram_size`` n: a token that would complete an n-gram the row already holds is banned
  (transformers' ``NoRepeatNGramLogitsProcessor``), which stops beam and greedy output from looping
  ("the the the").

Both read the step's history (``TokenRows.history``, API 1.21) and act on every row in one pass
over a padded batch; rows that leave both at their neutral values (1 and 0) are untouched, and a step
where all do costs nothing.
"""

import torch

from lmlab.api import DecodingOptions, Field, TokenRows


class PenaltyOptions(DecodingOptions):
    repetition_penalty: float = Field(1.0, gt=0, help="> 1 divides (multiplies, when negative) the logits of "
                                                      "tokens already in the text (CTRL, transformers' definition); 1: off")
    no_repeat_ngram_size: int = Field(0, ge=0, help="n: never repeat an n-gram of the text (transformers' "
                                                    "definition); 0: off")


def penalize(logits: torch.Tensor, rows: TokenRows) -> torch.Tensor:
    """logits (B, V) with each row's repetition penalty and n-gram ban applied (a new tensor, or
    ``logits`` itself when no row asks for either, or no history is kept)."""
    penalty = rows.values("repetition_penalty", 1.0)
    sizes = rows.values("no_repeat_ngram_size", 0, dtype=torch.long)
    repeat, ngram = bool((penalty != 1).any()), bool((sizes > 0).any())
    if not (repeat or ngram) or rows.history is None:
        return logits
    B, V = logits.shape
    history = rows.history
    longest = max(len(h) for h in history)
    # Padded with V: a column past the vocabulary, added for the step and dropped after, takes what pads do.
    ids = torch.full((B, max(longest, 1)), V, dtype=torch.long, device=logits.device)
    for r, h in enumerate(history):
        if h:
            ids[r, :len(h)] = torch.tensor(h, dtype=torch.long, device=logits.device)
    scores = torch.cat([logits, logits.new_zeros(B, 1)], dim=1)
    if repeat:
        seen = scores.gather(1, ids)
        p = penalty.to(scores.dtype)[:, None]
        scores = scores.scatter(1, ids, torch.where(seen < 0, seen * p, seen / p))
    if ngram:
        scores = _ban_repeated_ngrams(scores, ids, [len(h) for h in history], sizes, V)
    return scores[:, :V]


def _ban_repeated_ngrams(scores: torch.Tensor, ids: torch.Tensor, lengths: list[int], sizes: torch.Tensor,
                         V: int) -> torch.Tensor:
    """Each row's tokens that would complete an n-gram (n: its size) already in its history set to -inf."""
    banned = torch.zeros_like(scores, dtype=torch.bool)
    for n in sorted(set(sizes.tolist()) - {0}):
        chosen = (sizes == n).nonzero()[:, 0]
        if ids.shape[1] < n:
            continue
        windows = ids[chosen].unfold(1, n, 1)  # (b, L - n + 1, n): every n-gram, pads included
        rows_len = torch.tensor([lengths[i] for i in chosen.tolist()], device=ids.device)
        # The row's last n - 1 tokens, which a next token would complete into an n-gram.
        at = (rows_len[:, None] - (n - 1) + torch.arange(n - 1, device=ids.device)).clamp(min=0)
        tail = ids[chosen].gather(1, at)  # (b, n - 1)
        start = torch.arange(windows.shape[1], device=ids.device)
        whole = start[None, :] + n <= rows_len[:, None]  # windows inside the history, not over its pads
        match = (windows[:, :, :n - 1] == tail[:, None, :]).all(-1) & whole & (rows_len[:, None] >= n)
        ban = torch.where(match, windows[:, :, n - 1], torch.full_like(windows[:, :, n - 1], V))
        banned[chosen] = banned[chosen].scatter(1, ban, True)
    banned[:, V] = False
    return scores.masked_fill(banned, float("-inf"))
