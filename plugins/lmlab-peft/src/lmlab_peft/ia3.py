"""Infused adapters by inhibiting and amplifying inner activations: ``ia3`` (Liu et al. 2022, "Few-Shot
Parameter-Efficient Fine-Tuning is Better and Cheaper than In-Context Learning").

(IA)³ learns one vector per adapted layer that rescales activations elementwise: the keys and values
of attention (the outputs of the ``k`` and ``v`` projections, l_k ⊙ K, l_v ⊙ V) and the hidden
activation of the feed-forward network (the input of its ``down`` projection, W_down (l_ff ⊙ h)). The
vectors start at one, so the adapted model starts as the base model, and they train far fewer numbers
than LoRA (d_model per attention layer and the hidden width per ffn). Scaling a linear layer's input
or output folds into its weight, so the adapter merges.
"""

from lmlab.api import Field, Options, UserError, resolve_roles
from lmlab_peft.library import LibraryMethod, Targets, pattern, targets_field


class IA3Options(Options):
    targets: Targets = targets_field(["k", "v", "down"])
    feedforward: list[str] = Field(
        ["down"], help="of the targets, the roles whose input is scaled (the feed-forward hidden activation "
                       "entering 'down'); the output of the others is scaled")


class IA3(LibraryMethod):
    """``ia3``: learned elementwise scales on keys, values and the ffn's hidden activation."""

    Options = IA3Options
    tuner_class = "IA3Model"

    def config(self, peft, targets, model, run):
        wanted = self.options.targets
        outside = [r for r in self.options.feedforward if wanted != "all" and r not in wanted]
        if outside:
            raise UserError(f"role {outside[0]!r} is not among the targets {wanted}", key="peft.feedforward")
        feedforward = resolve_roles(model, self.options.feedforward, key="peft.feedforward") \
            if self.options.feedforward else []
        return peft.IA3Config(target_modules=targets, feedforward_modules=pattern(feedforward) or None)
