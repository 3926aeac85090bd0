"""Learning-rate schedule: linear warmup, then cosine, linear or no decay to a floor."""

import math


def lr_factor(step: int, *, warmup: int, decay_steps: int, min_ratio: float, kind: str) -> float:
    """Multiplier of the peak learning rate at optimizer step ``step`` (0-based)."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if kind == "constant":
        return 1.0
    if step >= decay_steps:
        return min_ratio
    progress = (step - warmup) / max(1, decay_steps - warmup)
    shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if kind == "cosine" else 1.0 - progress
    return min_ratio + (1.0 - min_ratio) * shape


class WarmupDecay:
    """A picklable LambdaLR function (its state is saved with the scheduler)."""

    def __init__(self, warmup: int, decay_steps: int, min_ratio: float, kind: str):
        self.warmup, self.decay_steps, self.min_ratio, self.kind = warmup, decay_steps, min_ratio, kind

    def __call__(self, step: int) -> float:
        return lr_factor(step, warmup=self.warmup, decay_steps=self.decay_steps,
                         min_ratio=self.min_ratio, kind=self.kind)
