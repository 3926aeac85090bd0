"""What a training step consumes: the sampled token windows, and the batch an objective makes of them."""

import dataclasses
from dataclasses import dataclass

import numpy as np
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


def stream_seed(*key: int) -> int:
    """A 63-bit seed from integers (run seed, stream, batch index), well mixed by numpy's SeedSequence,
    so that neighbouring batches get unrelated random streams."""
    low, high = np.random.SeedSequence(list(key)).generate_state(2, np.uint32).tolist()
    return ((high & 0x7FFFFFFF) << 32) | low


@dataclass
class Windows:
    """What an objective that overrides ``Objective.make_batch_from`` receives (API 1.4): rows of
    tokens and what was sampled alongside them, already on the training device.

    ``tokens`` (B, L) int64: consecutive tokens of the corpus, L = block_size + 1 (a random or fixed
    window; with ``Objective.sampling = "documents"`` one document per row from its first token,
    truncated, and padded where ``padding`` is True). ``labels`` (B, L) uint8: what the objective's
    ``token_labels`` gave for these positions (None when it gave nothing). ``padding`` (B, L) bool,
    True on padding (None: no row is padded); padded tokens hold an arbitrary id.

    Randomness: :meth:`rand` and :meth:`randint` draw from a generator seeded by the run's seed, the
    split and the batch index, so a batch's random choices (which tokens to mask) are the same again
    in a resumed run. The draw is made for the whole global batch and sliced (``first_row``,
    ``total_rows``), so a data-parallel replica gets exactly the numbers a single device drawing the
    global batch would for the same rows. Successive calls continue one stream: make them in a fixed
    order.
    """

    tokens: torch.Tensor
    labels: torch.Tensor | None = None
    padding: torch.Tensor | None = None
    seed: int = 0
    first_row: int = 0  # this batch's first row within the global batch
    total_rows: int | None = None  # rows of the global batch; None: this batch is the whole of it

    def to(self, device, non_blocking: bool = False) -> "Windows":
        """The same windows on ``device`` (Lightning moves batches with this)."""
        def move(t):
            return None if t is None else t.to(device, non_blocking=non_blocking)
        return dataclasses.replace(self, tokens=move(self.tokens), labels=move(self.labels),
                                   padding=move(self.padding))

    def pin_memory(self) -> "Windows":
        def pin(t):
            return None if t is None else t.pin_memory()
        return dataclasses.replace(self, tokens=pin(self.tokens), labels=pin(self.labels), padding=pin(self.padding))

    @property
    def generator(self) -> torch.Generator:
        """This batch's generator, on the tokens' device (created at the first draw)."""
        generator = self.__dict__.get("_generator")
        if generator is None:
            generator = torch.Generator(device=self.tokens.device).manual_seed(self.seed)
            self.__dict__["_generator"] = generator
        return generator

    def rand(self, *size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(B, *size) uniform numbers in [0, 1): this batch's rows of a draw for the global batch."""
        rows = self.tokens.shape[0]
        total = self.total_rows or rows
        drawn = torch.rand((total, *size), generator=self.generator, device=self.tokens.device, dtype=dtype)
        return drawn[self.first_row:self.first_row + rows]

    def randint(self, high: int, *size: int) -> torch.Tensor:
        """(B, *size) int64 uniform in [0, high): this batch's rows of a draw for the global batch."""
        rows = self.tokens.shape[0]
        total = self.total_rows or rows
        drawn = torch.randint(0, high, (total, *size), generator=self.generator, device=self.tokens.device)
        return drawn[self.first_row:self.first_row + rows]
