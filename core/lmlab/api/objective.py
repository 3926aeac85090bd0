"""The objective slot: what the model learns to predict, and how batches are drawn for it.

The simplest objective (``causal-lm``) takes windows of T+1 consecutive tokens through
:meth:`Objective.make_batch` and scores every next token. An objective that needs more (API 1.4)
says so with class attributes and methods the core reads once, when the run is built:

- ``causal = False``: the model is built with bidirectional attention (``MixerContext.causal`` False),
  which only attention plugins declaring ``Attention.bidirectional`` support; another is refused,
  naming ``attention.use``. Such a model cannot generate text left to right.
- ``special_tokens``: names of tokens the objective inserts (``("mask",)`` for BERT's [MASK]). Each
  gets the tokenizer's own id when it has one (``Tokenizer.special_id``), else an id past the
  tokenizer's vocabulary; the model's vocabulary grows to hold them (unless ``model.vocab_size``
  already leaves room). :meth:`setup` receives the ids in a :class:`Vocabulary`.
- ``sampling = "documents"``: each row of a batch is one document from its first token, truncated to
  block_size + 1 tokens and padded (training draws documents in a shuffled order per epoch, a pure
  function of seed and step; validation takes every validation document once).
- :meth:`token_labels`: per-token labels sampled alongside the windows (the prepared loss mask of a
  corpus of Records, regions of code, ...), computed from a :class:`TokenSplit` once per split.
- :meth:`make_batch_from`: overriding it is what asks for all of the above: it receives
  :class:`~lmlab.api.batch.Windows` (tokens, labels, padding, a seeded random stream) instead of a
  plain tensor. An objective that does not override it costs nothing extra per step.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import numpy as np
import torch

from lmlab.api.batch import Batch, Windows
from lmlab.api.plugin import Plugin


@dataclass(frozen=True)
class Vocabulary:
    """The token ids of a run, as :meth:`Objective.setup` sees them (API 1.4).

    ``tokenizer_size``: the tokenizer produces ids in [0, tokenizer_size). ``size``: rows of the model's
    embedding and head (≥ tokenizer_size + the reserved special ids). ``special``: name → id of each
    token of ``Objective.special_tokens``, the tokenizer's own or reserved past its vocabulary.
    """

    size: int
    tokenizer_size: int
    special: Mapping[str, int] = field(default_factory=dict)
    eos_id: int | None = None


@dataclass(frozen=True)
class TokenSplit:
    """One split of the prepared corpus, as :meth:`Objective.token_labels` sees it (API 1.4).

    ``tokens`` (N,) token ids and ``loss_mask`` (N,) uint8 are array-likes (a numpy memmap, or a view
    of several shards) supporting ``len``, slicing and integer-array indexing of any shape; read them in
    chunks, not whole, as a corpus may not fit in memory. ``loss_mask`` is 1 where a prompt-masked
    objective scores the token (the scored segments of Records and each document's end token); None
    when the corpus has no unscored text. ``document_starts`` (n_documents,) int64: the offset of each
    document's first token (documents are consecutive, each ending where the next starts).
    """

    name: Literal["train", "val"]
    tokens: Any
    loss_mask: Any | None
    document_starts: np.ndarray
    tokenizer: Any  # the fitted lmlab.api.Tokenizer


#: positions (B, L) int64 of tokens in a split → their labels (B, L) uint8
LabelFunction = Callable[[np.ndarray], np.ndarray]


class Objective(Plugin):
    """What the model learns: how a batch of token windows (or documents) becomes inputs and targets,
    and the loss over them. It also says what it needs of the model and the data: causal or not,
    special tokens, windows or padded documents, per-token labels."""

    slot = "objective"

    #: False: every position sees the whole window (bidirectional attention), e.g. masked LM (API 1.4).
    causal: ClassVar[bool] = True
    #: Names of the special tokens the objective needs ids for, e.g. ("mask",) (API 1.4).
    special_tokens: ClassVar[tuple[str, ...]] = ()
    #: "windows": rows are windows of block_size + 1 consecutive tokens at random (training) or fixed
    #: (validation) offsets; "documents": one document per row, truncated and padded (API 1.4). An
    #: instance may set it from its options.
    sampling: Literal["windows", "documents"] = "windows"

    def setup(self, vocab: Vocabulary) -> None:
        """Called once when the run is built, before any batch: the model's vocabulary and the ids of
        ``special_tokens`` (API 1.4). Default: nothing."""

    def token_labels(self, split: TokenSplit) -> LabelFunction | None:
        """Called once per split when the run is built, for objectives that override
        :meth:`make_batch_from` (API 1.4): a function from token positions (B, L) to per-token labels
        (B, L) uint8, which the sampler applies to every batch's positions (``Windows.labels``); or
        None (default) for no labels. Vectorise it: it runs on every batch. Raise ``UserError`` when
        the data cannot serve the objective (a prompt-masked objective on a corpus without masks)."""
        return None

    def make_batch(self, windows: torch.Tensor) -> Batch:
        """windows (B, T+1) of consecutive tokens → a Batch. Default: predict the next token."""
        return Batch(windows[:, :-1], windows[:, 1:])

    def make_batch_from(self, windows: Windows) -> Batch:
        """A :class:`~lmlab.api.batch.Windows` (tokens (B, T+1), labels, padding, a seeded random
        stream) → a Batch whose ``input_ids`` have at most block_size columns (API 1.4). Override it to
        receive Windows; the default passes the tokens to :meth:`make_batch`."""
        return self.make_batch(windows.tokens)

    @classmethod
    def wants_windows(cls) -> bool:
        """Whether batches reach this objective as Windows (it overrides :meth:`make_batch_from`)."""
        return cls.make_batch_from is not Objective.make_batch_from

    def loss(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        """logits (B, T, V) → scalar loss to minimise (and to report as train/val loss)."""
        raise NotImplementedError
