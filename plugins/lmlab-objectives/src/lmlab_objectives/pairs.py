"""Preference pairs as the model reads them: one record row → a chosen and a rejected sequence.

A ``preferences`` record is prepared as one document, prompt | chosen | rejected, with the loss mask
0 on the prompt, 1 on the chosen answer and 2 on the rejected one (``Segment.label``). The pair
objectives (``reward-model``, ``dpo``) sample one record per row (``sampling = "documents"``) and
split it here, vectorised over the batch: rows 0..B-1 of the result are prompt + chosen, rows
B..2B-1 prompt + rejected, each packed to the left and padded on the right, with targets only on the
answer's tokens. Both halves of a pair go through the model in one forward pass.

A record longer than a row (block_size + 1 tokens) loses its end, and with it part of the rejected
answer: such pairs are left out of the loss and counted (``report("truncated")``), since scoring half
an answer against a whole one would teach length, not preference. The core counts them over the
whole corpus before training (``drops_truncated``): a warning in the run's warnings.log with how
many, and a refusal naming ``model.block_size`` when none fits. (TRL cuts the prompt from the left
instead; here a row holds the record from its first token, so a record whose end does not fit has
already lost its rejected answer: raise ``model.block_size``, or filter long records out.)
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lmlab.api import IGNORE_INDEX, Batch, Objective, TokenSplit, UserError, Vocabulary, Windows

PROMPT, CHOSEN, REJECTED = 0, 1, 2


@dataclass
class PairBatch(Batch):
    """``input_ids``/``targets`` (2B, T): the chosen sequences, then the rejected ones."""

    last: torch.Tensor = None
    """(2B,) int64: each sequence's last real position in ``input_ids`` (where a reward head reads)."""
    valid: torch.Tensor = None
    """(B,) bool: pairs whose record fit its row whole, with both answers non-empty."""

    @property
    def pairs(self) -> int:
        return self.valid.shape[0]

    def n_scored(self) -> torch.Tensor:
        """Evaluation weights a batch by its pairs (the loss is a mean over pairs)."""
        return self.valid.sum()

    def halves(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(2B, ...) → the chosen half and the rejected half."""
        return values[:self.pairs], values[self.pairs:]


def check_preference_data(split) -> None:
    """A corpus without the preference mask (plain text, or Records without a rejected part) cannot
    make pairs: refused when the run's data is set up, naming the data slot."""
    if split.loss_mask is None:
        raise UserError("this objective trains on preference pairs (prompt, chosen, rejected), and the corpus has no "
                        "loss mask; use the preferences data plugin", key="data.use")


def split_pairs(windows: Windows, eos_id: int | None = None, pad_id: int = 0) -> PairBatch:
    """Each row of ``windows`` (tokens and labels (B, L), one record per row) → its chosen and
    rejected sequences. With a tokenizer that ends documents with ``eos_id``, the record's end token
    follows the rejected answer only; the chosen sequence gets one too, so both answers end alike."""
    tokens, labels = windows.tokens, windows.labels.long()  # (B, L)
    if windows.padding is not None:
        labels = labels.masked_fill(windows.padding, PROMPT)
    B, L = tokens.shape
    answered = (labels != PROMPT).cumsum(dim=1) > 0  # (B, L): from the first answer token on
    prompt = ~answered
    if windows.padding is not None:
        prompt &= ~windows.padding
    chosen_keep, rejected_keep = prompt | (labels == CHOSEN), prompt | (labels == REJECTED)
    # A record that fit its row leaves padding at the end; a full row may have lost its tail.
    fits = windows.padding[:, -1] if windows.padding is not None else torch.zeros(B, dtype=torch.bool,
                                                                                  device=tokens.device)
    valid = fits & (labels == CHOSEN).any(dim=1) & (labels == REJECTED).any(dim=1)
    keep = torch.cat([chosen_keep, rejected_keep])  # (2B, L)
    rows = torch.cat([tokens, tokens])
    marks = torch.cat([labels, labels])
    # Pack each row's kept tokens to the left, in order: a stable sort puts kept (0) before dropped (1).
    order = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices
    ids = rows.gather(1, order)
    marks = marks.gather(1, order)
    lengths = keep.sum(dim=1)  # (2B,)
    if eos_id is not None:
        # The record's end token is the last kept token of its rejected row; give the chosen row one.
        rejected_last = ids[B:].gather(1, (lengths[B:] - 1).clamp(min=0)[:, None]).squeeze(1)
        add = (rejected_last == eos_id) & (lengths[:B] < L)
        at = lengths[:B].clamp(max=L - 1)
        chosen_ids, chosen_marks = ids[:B].clone(), marks[:B].clone()
        chosen_ids[add, at[add]] = eos_id
        chosen_marks[add, at[add]] = CHOSEN
        ids, marks = torch.cat([chosen_ids, ids[B:]]), torch.cat([chosen_marks, marks[B:]])
        lengths = torch.cat([lengths[:B] + add.long(), lengths[B:]])
    position = torch.arange(L, device=tokens.device)
    real = position[None, :] < lengths[:, None]  # (2B, L)
    ids = ids.masked_fill(~real, pad_id)
    answer = real & (marks != PROMPT)
    targets = ids[:, 1:].masked_fill(~answer[:, 1:], IGNORE_INDEX)
    last = (lengths - 1).clamp(min=0, max=L - 2)  # inputs are ids[:, :-1]: a full row's last input is L - 2
    return PairBatch(ids[:, :-1], targets, last=last, valid=valid)


def sequence_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(rows,) float32: the sum over each row's answer tokens of log p(token), from logits (rows, T, V)."""
    rows, T, V = logits.shape
    nll = F.cross_entropy(logits.float().reshape(-1, V), targets.reshape(-1), ignore_index=IGNORE_INDEX,
                          reduction="none")
    return -nll.view(rows, T).sum(dim=1)


def masked_mean(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` (B,) over ``valid`` pairs; 0, with a gradient of 0, when there is none."""
    weights = valid.to(values.dtype)
    return (values * weights).sum() / weights.sum().clamp(min=1)


class PairObjective(Objective):
    """An objective of ranked pairs: one ``preferences`` record per row (padded documents), split here
    into its chosen and rejected sequences; subclasses define ``forward_loss`` on the PairBatch."""

    sampling = "documents"
    drops_truncated = True  # API 1.16: the core counts the pairs too long for a row, and warns

    def setup(self, vocab: Vocabulary) -> None:
        self.eos_id = vocab.eos_id

    def token_labels(self, split: TokenSplit):
        check_preference_data(split)
        mask = split.loss_mask
        return lambda positions: mask[positions]

    def make_batch_from(self, windows: Windows) -> PairBatch:
        return split_pairs(windows, self.eos_id)
