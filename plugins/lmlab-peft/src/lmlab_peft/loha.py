"""Low-rank Hadamard product: ``loha`` (Hyeon-Woo et al. 2022, "FedPara: Low-Rank Hadamard Product for
Communication-Efficient Federated Learning"; as in LyCORIS, Yeh et al. 2024).

The update of a frozen weight is the elementwise product of two low-rank matrices,
ΔW = (alpha / r) · (B₁ A₁) ⊙ (B₂ A₂): with 2·r·(in + out) numbers it reaches rank up to r², where
LoRA's r·(in + out) reach rank r. One factor of one pair starts at zero, so the adapted model starts
as the base model; ΔW folds into the weight (the adapter merges).
"""

from lmlab.api import Field, Options
from lmlab_peft.library import LibraryMethod, Targets, targets_field


class LoHaOptions(Options):
    r: int = Field(8, gt=0, help="rank of each of the two low-rank factors")
    alpha: float = Field(8.0, gt=0, help="the update is scaled by alpha / r")
    rank_dropout: float = Field(0.0, ge=0, lt=1, help="dropout over the rank dimension of the update, in training")
    module_dropout: float = Field(0.0, ge=0, lt=1, help="probability of leaving a layer's update out in a step")
    targets: Targets = targets_field(["q", "v"])


class LoHa(LibraryMethod):
    """``loha``: ΔW = (alpha / r) · (B₁A₁) ⊙ (B₂A₂)."""

    Options = LoHaOptions
    tuner_class = "LoHaModel"

    def config(self, peft, targets, model, run):
        o = self.options
        return peft.LoHaConfig(r=o.r, alpha=o.alpha, rank_dropout=o.rank_dropout, module_dropout=o.module_dropout,
                               target_modules=targets)
