"""A reward model: a scalar head on the language model, trained on ranked pairs (``reward-model``).

InstructGPT's second stage (Ouyang et al. 2022, section 3.5; Stiennon et al. 2020 before it): the
supervised model's final hidden state at an answer's last token goes through a linear head to one
number, r(prompt, answer), and pairs ranked by people train it with the Bradley–Terry likelihood
that the chosen answer wins, ``-log σ(r_chosen − r_rejected)``. Only the difference of rewards is
learnt, so their offset is arbitrary: PPO whitens or centres rewards before using them.

Data: the ``preferences`` data plugin (one record per row, split by :mod:`lmlab_objectives.pairs`).
The model usually starts from the SFT run (``[init]``); the head starts small (N(0, 1/(d+1)), as
TRL's value heads do) so the first rewards are near 0. The head is ``model.heads["reward"]`` and is
saved with the run, so a PPO run loads this run's folder as its reward model.

Reported (``val_accuracy`` in the summary): the share of held-out pairs whose chosen answer gets the
higher reward, and the mean margin r_chosen − r_rejected.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from lmlab.api import Field, Options
from lmlab_objectives.pairs import PairBatch, PairObjective, masked_mean

HEAD = "reward"


class RewardHead(nn.Linear):
    """d_model → 1, initialised small so a fresh head gives rewards near 0."""

    def __init__(self, d_model: int):
        super().__init__(d_model, 1)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=1.0 / math.sqrt(self.in_features + 1))
        nn.init.zeros_(self.bias)


def score(model, ids: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """(rows,) float32: the reward head's score of token rows ``ids`` (rows, T), read at positions
    ``last`` (rows,), each sequence's last real token. What PPO asks of the run this objective trained."""
    hidden = model(ids, hidden=True)  # (rows, T, C)
    at = hidden[torch.arange(ids.shape[0], device=ids.device), last]  # (rows, C)
    return model.heads[HEAD](at).squeeze(-1).float()


class RewardModelOptions(Options):
    margin_l2: float = Field(0.0, ge=0, help="coefficient of a penalty on (r_chosen + r_rejected)^2, which keeps "
                                             "the rewards centred on 0 (the loss sees only their difference)")


class RewardModel(PairObjective):
    """``reward-model``: Bradley–Terry loss on (chosen, rejected) pairs through a scalar head."""

    Options = RewardModelOptions
    api = ">=1.10,<2"  # forward_loss, heads, report; Segment.label

    def heads(self, shape):
        return {HEAD: RewardHead(shape.d_model)}

    def forward_loss(self, model, batch: PairBatch) -> torch.Tensor:
        chosen, rejected = batch.halves(score(model, batch.input_ids, batch.last))
        margin = chosen - rejected
        loss = masked_mean(-F.logsigmoid(margin), batch.valid)
        if self.options.margin_l2 > 0:
            loss = loss + self.options.margin_l2 * masked_mean((chosen + rejected).square(), batch.valid)
        valid = batch.valid
        self.report("accuracy", (margin[valid] > 0).float())
        self.report("margin", margin[valid])
        self.report("truncated", (~valid).float())
        return loss
