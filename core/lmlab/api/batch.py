"""What a training step consumes."""

from dataclasses import dataclass

import torch

IGNORE_INDEX = -100  # targets with this value contribute nothing to the loss


@dataclass
class Batch:
    """input_ids (B, T) and targets (B, T) of token ids; targets may hold IGNORE_INDEX."""

    input_ids: torch.Tensor
    targets: torch.Tensor

    @property
    def n_tokens(self) -> int:
        return self.input_ids.numel()
