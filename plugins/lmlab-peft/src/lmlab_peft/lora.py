"""Low-rank adaptation: ``lora`` (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models")
and ``dora`` (Liu et al. 2024, "DoRA: Weight-Decomposed Low-Rank Adaptation").

LoRA freezes a pretrained weight W (out × in) and learns its update as a product of two thin
matrices: h = W x + (alpha / r) · B A x, with A (r × in) drawn at random and B (out × r) zero, so the
adapted model starts as the base model and only r·(in + out) numbers per layer train. The update
folds into the weight after training (W + (alpha / r) · B A), so a merged model costs nothing extra
at inference. Rank-stabilised LoRA (Kalajdzievski 2023, "A Rank Stabilization Scaling Factor for
Fine-Tuning with LoRA") scales by alpha / sqrt(r) instead, which keeps the update's size steady as r
grows. Hu et al. adapt the query and value projections (``targets = ["q", "v"]``, the default).

DoRA splits each adapted weight into a magnitude and a direction, W' = m · (W + s·BA) / ||W + s·BA||
(column norms), trains m (one number per output row of W's transpose) with LoRA on the direction, and
merges to a plain weight as LoRA does.
"""

from lmlab.api import Field, Options
from lmlab_peft.library import LibraryMethod, Targets, targets_field


class LoRAOptions(Options):
    r: int = Field(8, gt=0, help="rank of the update B·A")
    alpha: float = Field(16.0, gt=0, help="the update is scaled by alpha / r (alpha / sqrt(r) with rslora)")
    dropout: float = Field(0.0, ge=0, lt=1, help="dropout on the input of the update branch")
    targets: Targets = targets_field(["q", "v"])
    rslora: bool = Field(False, help="rank-stabilised scaling alpha / sqrt(r) (Kalajdzievski 2023)")


class LoRA(LibraryMethod):
    """``lora``: W x + (alpha / r) · B A x on the target layers, B zero at the start."""

    Options = LoRAOptions
    tuner_class = "LoraModel"
    dora = False

    def config(self, peft, targets, model, run):
        o = self.options
        return peft.LoraConfig(r=o.r, lora_alpha=o.alpha, lora_dropout=o.dropout, target_modules=targets,
                               use_rslora=o.rslora, use_dora=self.dora, bias="none")


class DoRA(LoRA):
    """``dora``: a trained magnitude per output feature times a LoRA-adapted direction."""

    dora = True
