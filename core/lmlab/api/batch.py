"""What a training step consumes: the sampled token windows, and the batch an objective makes of them."""

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

IGNORE_INDEX = -100
"""Targets with this value contribute nothing to the loss (``torch.nn.functional.cross_entropy``'s
default ``ignore_index``), nor to the count by which evaluation weights each batch's loss."""


@dataclass
class Batch:
    """What an objective makes of sampled tokens
    ([Objective.make_batch][lmlab.api.objective.Objective.make_batch]): the model's input and what
    [Objective.loss][lmlab.api.objective.Objective.loss] scores its logits against."""

    input_ids: torch.Tensor
    """(B, T) int64 token ids fed to the model, T ≤ ``model.block_size``."""
    targets: torch.Tensor
    """(B, T) int64 target ids, one per input position;
    [IGNORE_INDEX][lmlab.api.batch.IGNORE_INDEX] where nothing is scored."""

    @property
    def n_tokens(self) -> int:
        """Input tokens in the batch (B · T)."""
        return self.input_ids.numel()

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """What the model's forward takes besides ``input_ids`` (API 1.13): nothing for a decoder-only
        batch; an encoder–decoder batch's encoder tokens. The core calls
        ``model(batch.input_ids, **batch.model_inputs())``, and so should an objective that runs the
        model itself."""
        return {}

    def n_scored(self) -> torch.Tensor:
        """What evaluation weights this batch's loss by, to get the loss of the whole split: the
        number of targets that are not [IGNORE_INDEX][lmlab.api.batch.IGNORE_INDEX] (a 0-dim tensor).
        A batch whose loss is a mean over something else (pairs, sequences) overrides it (API 1.10)."""
        return (self.targets != IGNORE_INDEX).sum()


@dataclass
class Seq2SeqBatch(Batch):
    """A batch for an encoder–decoder model (API 1.13): the encoder reads ``encoder_ids``, the decoder
    reads ``input_ids`` (the targets shifted right behind ``Vocabulary.decoder_start_id``) and is
    scored against ``targets``."""

    encoder_ids: torch.Tensor | None = None
    """(B, S) int64 token ids the encoder reads."""
    encoder_padding: torch.Tensor | None = None
    """(B, S) bool, True where ``encoder_ids`` is padding (never attended); None: no padding."""

    @property
    def n_tokens(self) -> int:
        """Tokens the model reads: the decoder's and the encoder's."""
        return self.input_ids.numel() + self.encoder_ids.numel()

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """``encoder_ids`` and ``encoder_padding``, as the encoder–decoder model's forward takes them."""
        return {"encoder_ids": self.encoder_ids, "encoder_padding": self.encoder_padding}


def stream_seed(*key: int) -> int:
    """A 63-bit seed from integers (run seed, stream, batch index), well mixed by numpy's SeedSequence,
    so that neighbouring batches get unrelated random streams."""
    low, high = np.random.SeedSequence(list(key)).generate_state(2, np.uint32).tolist()
    return ((high & 0x7FFFFFFF) << 32) | low


@dataclass
class Windows:
    """What an objective that overrides
    [Objective.make_batch_from][lmlab.api.objective.Objective.make_batch_from] receives (API 1.4):
    rows of tokens and what was sampled alongside them, already on the training device.

    Randomness: [rand][lmlab.api.batch.Windows.rand] and [randint][lmlab.api.batch.Windows.randint]
    draw from a generator seeded by the run's seed, the split and the batch index (in training, the
    optimizer step), so a batch's random choices (which tokens to mask) are the same again in a
    resumed run. The draw is made for the whole global batch and sliced (``first_row``,
    ``total_rows``), so a data-parallel replica gets exactly the numbers a single device drawing the
    global batch would for the same rows. Successive calls continue one stream: make them in a fixed
    order.
    """

    tokens: torch.Tensor
    """(B, L) int64: consecutive tokens of the corpus, L = block_size + 1 (a random or fixed window;
    with ``Objective.sampling = "documents"`` one document per row from its first token, truncated,
    and padded where ``padding`` is True)."""
    labels: torch.Tensor | None = None
    """(B, L) uint8: what the objective's ``token_labels`` gave for these positions (None when it
    gave nothing)."""
    padding: torch.Tensor | None = None
    """(B, L) bool, True on padding (None: no row is padded); padded tokens hold an arbitrary id."""
    seed: int = 0
    """The seed of this batch's random stream."""
    first_row: int = 0
    """This batch's first row within the global batch."""
    total_rows: int | None = None
    """Rows of the global batch; None: this batch is the whole of it."""

    def to(self, device, non_blocking: bool = False) -> "Windows":
        """The same windows on ``device`` (Lightning moves batches with this)."""
        def move(t):
            return None if t is None else t.to(device, non_blocking=non_blocking)
        return dataclasses.replace(self, tokens=move(self.tokens), labels=move(self.labels),
                                   padding=move(self.padding))

    def pin_memory(self) -> "Windows":
        """The same windows in pinned host memory (torch's DataLoader calls this with ``pin_memory=True``)."""
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
