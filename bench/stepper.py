"""What the architecture benchmarks share: a model built by lmlab from the quickstart manifest plus
overrides, trained by a plain loop (forward, backward, clip, optimizer step), and a runner that
alternates several such models in windows of steps so machine noise hits them alike."""

import statistics
import time
from pathlib import Path

import numpy as np
import torch

from lmlab import manifest
from lmlab.model import compute_loss
from lmlab.assemble import assemble
from lmlab.train import allocator

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "experiments" / "shakespeare-char.toml"


class ModelStepper:
    """One variant's model, objective and optimizer, stepping on random windows of tinyshakespeare."""

    def __init__(self, overrides: list[str], seed: int = 0, tune_malloc: bool = True):
        if tune_malloc:  # as `lmlab run` does before training (lmlab.train.allocator, bench/allocator.py)
            allocator.tune_for_training()
        (variant,) = manifest.load(QUICKSTART, ["tracker.use=none", *overrides])
        torch.manual_seed(seed)
        built = assemble(variant, data=True)
        self.model, self.objective = built.model, built.objective
        self.optimizer = built.plugins["optimizer"].build(self.model.param_infos())
        self.tokens = torch.from_numpy(built.tokens.train.astype(np.int64))
        self.B, self.T = variant.train.batch_size, variant.model.block_size
        self.params = self.model.num_params()
        self.generator = torch.Generator().manual_seed(seed)

    def steps(self, n: int) -> float:
        """Seconds per step over n training steps (the loss is synced once, at the end)."""
        offsets = torch.arange(self.T + 1)
        batches = [self.tokens[torch.randint(len(self.tokens) - self.T - 1, (self.B, 1), generator=self.generator)
                               + offsets] for _ in range(n)]
        start = time.perf_counter()
        for windows in batches:
            loss = compute_loss(self.model, self.objective, self.objective.make_batch(windows)).total
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        loss.item()
        return (time.perf_counter() - start) / n


def interleaved_medians(steppers: dict[str, ModelStepper], windows: int, every: int, warmup: int) -> dict[str, float]:
    """Median seconds per step of each stepper, taking turns in windows of ``every`` steps."""
    for stepper in steppers.values():
        stepper.steps(warmup)
    times: dict[str, list[float]] = {name: [] for name in steppers}
    for _ in range(windows):
        for name, stepper in steppers.items():
            times[name].append(stepper.steps(every))
    return {name: statistics.median(t) for name, t in times.items()}
