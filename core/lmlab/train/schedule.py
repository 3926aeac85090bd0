"""Learning-rate schedule: linear warmup, then cosine, linear, warmup-stable-decay, inverse-square-root
or no decay to a floor."""

import math


def lr_factor(step: int, *, warmup: int, decay_steps: int, min_ratio: float, kind: str,
              decay_fraction: float = 0.2) -> float:
    """Multiplier of the peak learning rate at optimizer step ``step`` (0-based)."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if kind == "constant":
        return 1.0
    if kind == "inverse-sqrt":  # Vaswani et al. 2017: continuous with the warmup at its end
        return max(min_ratio, math.sqrt(max(warmup, 1) / max(step, 1)))
    if step >= decay_steps:
        return min_ratio
    if kind == "wsd":
        # Warmup-stable-decay (Hu et al., MiniCPM, 2024): the peak until the last decay_fraction of the
        # run, then a linear decay to the floor; the stable phase's checkpoints can be decayed later.
        decay_start = max(warmup, decay_steps - round(decay_fraction * decay_steps))
        if step < decay_start:
            return 1.0
        progress = (step - decay_start) / max(1, decay_steps - decay_start)
        return min_ratio + (1.0 - min_ratio) * (1.0 - progress)
    progress = (step - warmup) / max(1, decay_steps - warmup)
    shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if kind == "cosine" else 1.0 - progress
    return min_ratio + (1.0 - min_ratio) * shape


class WarmupDecay:
    """A picklable LambdaLR function (its state is saved with the scheduler)."""

    def __init__(self, warmup: int, decay_steps: int, min_ratio: float, kind: str, decay_fraction: float = 0.2):
        self.warmup, self.decay_steps, self.min_ratio, self.kind = warmup, decay_steps, min_ratio, kind
        self.decay_fraction = decay_fraction

    def __call__(self, step: int) -> float:
        return lr_factor(step, warmup=self.warmup, decay_steps=self.decay_steps, min_ratio=self.min_ratio,
                         kind=self.kind, decay_fraction=getattr(self, "decay_fraction", 0.2))
