"""Low-rank Kronecker product: ``lokr`` (Edalati et al. 2022, "KronA: Parameter Efficient Tuning with
Kronecker Adapter"; as in LyCORIS, Yeh et al. 2024).

The update of a frozen weight is a Kronecker product ΔW = (alpha / r) · W₁ ⊗ W₂, W₁ small (about
the fourth root of the weight's size per side, or ``decompose_factor``) and W₂ the rest, itself
low rank (B A) when it is large: a full-rank update from very few numbers. W₂ starts at zero, so the
adapted model starts as the base model; ΔW folds into the weight (the adapter merges).
"""

from lmlab.api import Field, Options
from lmlab_peft.library import LibraryMethod, Targets, targets_field


class LoKrOptions(Options):
    r: int = Field(8, gt=0, help="rank of the larger Kronecker factor (when it is decomposed)")
    alpha: float = Field(8.0, gt=0, help="the update is scaled by alpha / r")
    rank_dropout: float = Field(0.0, ge=0, lt=1, help="dropout over the rank dimension of the update, in training")
    module_dropout: float = Field(0.0, ge=0, lt=1, help="probability of leaving a layer's update out in a step")
    decompose_both: bool = Field(False, help="make the smaller factor low rank too")
    decompose_factor: int = Field(-1, help="size of the smaller factor's side (-1: as square as possible)")
    targets: Targets = targets_field(["q", "v"])


class LoKr(LibraryMethod):
    """``lokr``: ΔW = (alpha / r) · W₁ ⊗ W₂."""

    Options = LoKrOptions
    tuner_class = "LoKrModel"

    def config(self, peft, targets, model, run):
        o = self.options
        return peft.LoKrConfig(r=o.r, alpha=o.alpha, rank_dropout=o.rank_dropout, module_dropout=o.module_dropout,
                               decompose_both=o.decompose_both, decompose_factor=o.decompose_factor,
                               target_modules=targets)
