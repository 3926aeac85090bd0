"""Direct preference optimisation (``dpo``): a policy tuned on ranked pairs against a frozen reference.

DPO (Rafailov et al. 2023, https://arxiv.org/abs/2305.18290) solves the KL-regularised RLHF problem
in closed form: the policy π is its own reward model, r(x, y) = β · log π(y|x) / π_ref(y|x), and the
Bradley–Terry likelihood of the ranked pairs becomes

    loss = −log σ(β · [(log π(y_w|x) − log π_ref(y_w|x)) − (log π(y_l|x) − log π_ref(y_l|x))])

over pairs of a chosen y_w and rejected y_l answer to a prompt x, with log-probabilities summed over
the answer's tokens. No sampling and no reward model: one forward pass of the policy and one of the
frozen reference per pair. β plays the role of PPO's KL coefficient: small β lets the policy move
far from the reference.

``loss_type`` also offers two variants of the same margin h = the bracket above:

- ``ipo`` (Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human
  Preferences", eq. 17): (h − 1/(2β))², which does not push the margin to infinity on pairs the
  policy already separates (DPO's overfitting on deterministic preferences).
- ``hinge`` (SLiC, Zhao et al. 2023): max(0, 1 − β · h).

``label_smoothing`` ε is cDPO's (Mitchell 2023): −(1 − ε) log σ(βh) − ε log σ(−βh), for labels
that are wrong with probability ε.

The reference is the ``[init]`` run unless ``reference`` names another run folder; it must share the
run's tokenizer (checked by the core, id by id). Reported: ``reward_accuracy`` (share of pairs whose
implicit reward ranks the chosen answer higher, h > 0), ``policy_accuracy`` (share of pairs whose
chosen answer the policy itself finds likelier, log π(y_w|x) > log π(y_l|x)), ``reward_margin``
(β · h), and the chosen and rejected answers' implicit rewards; the closing evaluation's are in the summary as
``val_reward_accuracy`` etc.
"""

from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F

from lmlab.api import Field, Options
from lmlab_objectives.pairs import PairBatch, PairObjective, masked_mean, sequence_logps


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, reference_chosen: torch.Tensor,
             reference_rejected: torch.Tensor, beta: float, loss_type: str = "sigmoid",
             label_smoothing: float = 0.0) -> torch.Tensor:
    """(B,) the per-pair loss from summed answer log-probabilities (B,) of the policy and the reference."""
    h = (policy_chosen - reference_chosen) - (policy_rejected - reference_rejected)
    if loss_type == "ipo":
        return (h - 1.0 / (2.0 * beta)).square()
    if loss_type == "hinge":
        return torch.relu(1.0 - beta * h)
    return -(1.0 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)


class DPOOptions(Options):
    beta: float = Field(0.1, gt=0, help="strength of the pull towards the reference (DPO: 0.1; smaller lets the "
                                        "policy move further)")
    loss_type: Literal["sigmoid", "ipo", "hinge"] = Field(
        "sigmoid", help="sigmoid: DPO's -log σ(β·h); ipo: (h - 1/(2β))²; hinge: SLiC's max(0, 1 - β·h)")
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, help="cDPO: the probability that a pair's ranking is wrong "
                                                           "(sigmoid loss only)")
    reference: Path | None = Field(None, help="the frozen reference run folder; unset: the [init] run")


class DPO(PairObjective):
    """``dpo``: the policy's and the frozen reference's log-probability ratios on (chosen, rejected)."""

    Options = DPOOptions
    api = ">=1.10,<2"  # forward_loss, needs_runs, prepare, report; Segment.label
    needs_runs = ("reference",)

    def prepare(self, context) -> None:
        self.reference = context.runs["reference"].model

    def forward_loss(self, model, batch: PairBatch) -> torch.Tensor:
        policy = sequence_logps(model(batch.input_ids), batch.targets)  # (2B,)
        with torch.no_grad():
            reference = sequence_logps(self.reference(batch.input_ids), batch.targets)
        pc, pr = batch.halves(policy)
        rc, rr = batch.halves(reference)
        o = self.options
        loss = masked_mean(dpo_loss(pc, pr, rc, rr, o.beta, o.loss_type, o.label_smoothing), batch.valid)
        valid = batch.valid
        chosen_reward, rejected_reward = o.beta * (pc - rc).detach(), o.beta * (pr - rr).detach()
        margin = (chosen_reward - rejected_reward)[valid]
        self.report("reward_accuracy", (margin > 0).float())
        # Which answer the policy itself finds likelier, reference aside: comparable across runs (an SFT
        # run scored with its own reference has every implicit reward 0).
        self.report("policy_accuracy", (pc > pr)[valid].float())
        self.report("reward_margin", margin)
        self.report("chosen_reward", chosen_reward[valid])
        self.report("rejected_reward", rejected_reward[valid])
        self.report("truncated", (~valid).float())
        return loss
