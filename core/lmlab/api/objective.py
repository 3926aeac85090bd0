"""The objective slot: turns token windows into batches and logits into a loss."""

import torch

from lmlab.api.batch import Batch
from lmlab.api.plugin import Plugin


class Objective(Plugin):
    slot = "objective"

    def make_batch(self, windows: torch.Tensor) -> Batch:
        """windows (B, T+1) of consecutive tokens → a Batch. Default: predict the next token."""
        return Batch(windows[:, :-1], windows[:, 1:])

    def loss(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        """logits (B, T, V) → scalar loss to minimise (and to report as train/val loss)."""
        raise NotImplementedError
