"""Adaptive budget allocation: ``adalora`` (Zhang et al. 2023, "AdaLoRA: Adaptive Budget Allocation for
Parameter-Efficient Fine-Tuning").

AdaLoRA writes each layer's update in the form of a singular value decomposition, ΔW = P Λ Q (P, Q
pushed towards orthogonality by a penalty added to the loss, Λ diagonal and starting at zero), and
moves rank to where it matters during training: every ``delta_t`` steps between ``tinit`` and
``total_step - tfinal`` it scores each singular triplet by a smoothed sensitivity |w · ∂L/∂w| with
its uncertainty, and zeroes the least important ones until the model holds ``target_r`` per layer on
average (starting from ``init_r``); for the last ``tfinal`` steps the allocation is fixed. The
pruning runs after each optimizer step (``lmlab_train_batch_end``, while the step's gradients are
still there); its running scores travel in checkpoints (``extra_state``), so a resumed run prunes
as an uninterrupted one would. The update is a change of weights, so the adapter merges.
"""

import torch

from lmlab.api import Field, Options, UserError, hookimpl
from lmlab_peft.library import ADAPTER, LibraryMethod, Targets, targets_field


class AdaLoRAOptions(Options):
    init_r: int = Field(12, gt=0, help="rank of every layer's update at the start")
    target_r: int = Field(8, gt=0, help="average rank per layer after pruning")
    alpha: float = Field(8.0, gt=0, help="the update is scaled by alpha / (rank kept)")
    dropout: float = Field(0.0, ge=0, lt=1, help="dropout on the input of the update branch")
    tinit: int = Field(0, ge=0, help="steps before pruning starts")
    tfinal: int = Field(0, ge=0, help="steps at the end with the allocation fixed")
    delta_t: int = Field(1, gt=0, help="prune every this many steps")
    beta1: float = Field(0.85, gt=0, lt=1, help="smoothing of the sensitivity scores")
    beta2: float = Field(0.85, gt=0, lt=1, help="smoothing of their uncertainty")
    orth_reg_weight: float = Field(0.5, ge=0, help="weight of the penalty ||PᵀP - I|| + ||QQᵀ - I|| in the loss")
    total_step: int | None = Field(None, gt=0, help="the schedule's length in steps (default: train.max_steps)")
    targets: Targets = targets_field(["q", "v"])


class AdaLoRA(LibraryMethod):
    """``adalora``: SVD-form low-rank updates whose rank is pruned by importance during training."""

    Options = AdaLoRAOptions
    tuner_class = "AdaLoraModel"

    def config(self, peft, targets, model, run):
        o = self.options
        total = o.total_step or run.train.max_steps
        if o.tinit >= total - o.tfinal:
            raise UserError(f"tinit ({o.tinit}) + tfinal ({o.tfinal}) leave no steps of {total} to allocate the "
                            "rank in", key="peft.tinit")
        if o.target_r > o.init_r:
            raise UserError(f"must not exceed init_r ({o.init_r})", key="peft.target_r")
        return peft.AdaLoraConfig(init_r=o.init_r, target_r=o.target_r, lora_alpha=o.alpha, lora_dropout=o.dropout,
                                  tinit=o.tinit, tfinal=o.tfinal, deltaT=o.delta_t, beta1=o.beta1, beta2=o.beta2,
                                  orth_reg_weight=o.orth_reg_weight, total_step=total, target_modules=targets)

    @hookimpl
    def lmlab_train_batch_end(self, step: int) -> None:
        self.tuner.update_and_allocate(step)

    def regularization(self, model):
        # AdaLoraModel.forward adds this to a Hugging Face model's output loss; lmlab calls the model
        # itself, so the same penalty joins the loss here: the mean over P and Q of ||PᵀP - I||_F.
        penalty, count = None, 0
        for name, p in model.named_parameters():
            if ("lora_A" in name or "lora_B" in name) and ADAPTER in name.split("."):
                gram = p @ p.T if "lora_A" in name else p.T @ p
                term = torch.linalg.matrix_norm(gram - torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device))
                penalty, count = (term if penalty is None else penalty + term), count + 1
        return self.options.orth_reg_weight * penalty / count

    def extra_state(self) -> dict:
        allocator = self.tuner.rankallocator
        return {"ipt": allocator.ipt, "exp_avg_ipt": allocator.exp_avg_ipt, "exp_avg_unc": allocator.exp_avg_unc,
                "rank_pattern": self.tuner.peft_config[ADAPTER].rank_pattern}

    def load_extra_state(self, state: dict) -> None:
        allocator = self.tuner.rankallocator
        allocator.ipt, allocator.exp_avg_ipt, allocator.exp_avg_unc = (
            dict(state["ipt"]), dict(state["exp_avg_ipt"]), dict(state["exp_avg_unc"]))
        self.tuner.peft_config[ADAPTER].rank_pattern = state["rank_pattern"]
