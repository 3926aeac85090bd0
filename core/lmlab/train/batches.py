"""Token windows (and padded documents) for training (random) and validation (fixed).

A training batch is a pure function of (seed, optimizer step): the *global* batch of a step (every
micro-batch of every data-parallel replica) is drawn at once, and each micro-batch of each replica
takes its slice. A resumed run therefore sees exactly the batches the interrupted one would have,
and batch_size B with grad_accum k on N data-parallel replicas sees the same data, in the same order,
as a single device with batch_size k·N·B and no accumulation: the runs are comparable step by step
(the parallel strategies' and accumulation's equivalence tests rely on it).

Most objectives (``causal-lm``) take plain (B, T+1) tensors of windows. An objective that overrides
``Objective.make_batch_from`` gets :class:`lmlab.api.Windows` instead: the same windows (or, with
``sampling = "documents"``, one document per row, padded), the per-token labels of its
``token_labels`` at those positions, and a random stream for the batch that is itself a function of
(seed, step) and sliced per replica from the global batch. Which of the two a run uses is decided
once, when it is built.
"""

import math

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset

from lmlab.api import Windows
from lmlab.api.batch import stream_seed

# Streams of one run's randomness, mixed with the seed: window offsets use default_rng([seed, 0, i]).
TRAIN_DRAWS, VAL_DRAWS, EPOCH_ORDER, REPLAY_DRAWS, CURRICULUM_DRAWS = 1, 2, 3, 4, 5


def _labels(labels, positions: np.ndarray) -> torch.Tensor | None:
    if labels is None:
        return None
    return torch.from_numpy(np.ascontiguousarray(labels(positions), dtype=np.uint8))


class EndlessBatches(IterableDataset):
    """Micro-batches ``batch(start)``, ``batch(start + 1)``, …: each a pure function of (seed, index), so
    a resumed run starts at its micro-step and every micro-batch of every data-parallel replica takes
    its rows of its optimizer step's global batch (:meth:`slot`)."""

    start: int = 0
    accum: int = 1  # micro-batches per optimizer step

    def batch(self, index: int):
        raise NotImplementedError

    def __iter__(self):
        index = self.start
        while True:
            yield self.batch(index)
            index += 1

    def slot(self, index: int) -> tuple[int, int, int]:
        """(optimizer step, first row within that step's global batch, rows of the global batch) of
        micro-batch ``index`` of this replica: micro-batch j of replica r holds rows (j·N + r)·B to
        (j·N + r + 1)·B of the k·N·B a single device would draw for the step in one batch."""
        step, micro = divmod(index, self.accum)
        total = self.batch_size * self.replicas * self.accum
        return step, (micro * self.replicas + self.replica) * self.batch_size, total

    def _windows(self, tokens: torch.Tensor, index: int, **fields) -> Windows:
        step, first, total = self.slot(index)
        return Windows(tokens, seed=stream_seed(self.seed, TRAIN_DRAWS, step), first_row=first, total_rows=total,
                       **fields)


class RandomWindows(EndlessBatches):
    """Endless batches (B, T+1) of windows starting at uniformly random offsets (nanoGPT's get_batch).

    ``rich``: yield :class:`~lmlab.api.Windows` with ``labels`` (a function of positions, from
    ``Objective.token_labels``) applied to the same positions; else plain tensors.
    """

    def __init__(self, tokens: np.ndarray, block_size: int, batch_size: int, seed: int,
                 replica: int = 0, replicas: int = 1, start: int = 0, rich: bool = False, labels=None,
                 accum: int = 1, curriculum=None, documents: tuple[np.ndarray, np.ndarray] | None = None,
                 weights: np.ndarray | None = None):
        if len(tokens) <= block_size + 1:
            raise ValueError(f"the training split has {len(tokens)} tokens; block_size {block_size} needs more")
        self.tokens, self.block_size, self.batch_size = tokens, block_size, batch_size
        self.seed, self.replica, self.replicas, self.start, self.accum = seed, replica, replicas, start, accum
        self.rich, self.labels = rich, labels
        self._offsets = np.arange(block_size + 1)
        # Drawing by document (``documents``: the (starts, ends) of the non-empty training documents):
        # while the data order (lmlab.train.curriculum.Schedule) restricts a step's pool, windows start
        # inside its documents only; with ``weights`` (one per document, from the filters), a window starts in a
        # document with probability proportional to its tokens times its weight.
        self.curriculum, self.documents, self.weights = curriculum, documents, weights

    def _document_starts(self, step: int, total: int) -> np.ndarray | None:
        """Window starts drawn by document, uniform within one; None when neither a curriculum nor
        weights restrict the plain uniform draw."""
        chosen = self.curriculum.pool(step) if self.curriculum is not None else None
        if chosen is None and self.weights is None:
            return None
        starts, ends = self.documents
        if chosen is None:
            chosen = np.arange(len(starts))
        sizes = ends[chosen] - starts[chosen]
        mass = sizes * (self.weights[chosen].astype(np.float64) if self.weights is not None else 1.0)
        rng = np.random.default_rng([self.seed, CURRICULUM_DRAWS, step])
        cdf = np.cumsum(mass)
        which = np.minimum(np.searchsorted(cdf, rng.random(total) * cdf[-1], side="right"), len(chosen) - 1)
        begin = starts[chosen][which] + rng.integers(0, sizes[which])
        return np.minimum(begin, len(self.tokens) - self.block_size - 2)

    def batch(self, index: int):
        step, first, total = self.slot(index)
        starts = self._document_starts(step, total) if self.documents is not None else None
        if starts is None:
            rng = np.random.default_rng([self.seed, 0, step])
            starts = rng.integers(0, len(self.tokens) - self.block_size - 1, size=total)
        mine = starts[first:first + self.batch_size]
        positions = mine[:, None] + self._offsets  # (B, T+1)
        tokens = torch.from_numpy(self.tokens[positions].astype(np.int64))
        if not self.rich:
            return tokens
        return self._windows(tokens, index, labels=_labels(self.labels, positions))


def _fixed_starts(n_tokens: int, block_size: int, limit: int | None) -> np.ndarray:
    starts = np.arange(0, n_tokens - block_size, block_size)
    if len(starts) == 0:
        raise ValueError(f"the validation split has {n_tokens} tokens; block_size {block_size} needs more")
    return _spread(starts, limit)


def _spread(items: np.ndarray, limit: int | None) -> np.ndarray:
    """``limit`` items evenly spread over ``items`` (all of them when None or when there are fewer)."""
    if limit is not None and limit < len(items):
        items = items[np.linspace(0, len(items) - 1, limit).round().astype(np.int64)]
    return items


class FixedWindows(Dataset):
    """Consecutive non-overlapping windows (T+1 tokens, stride T) covering the whole split.

    ``limit`` keeps a fixed, evenly spread subset (periodic evaluation); None keeps every window
    (the final evaluation, over the whole validation split).
    """

    def __init__(self, tokens: np.ndarray, block_size: int, limit: int | None = None):
        self.tokens, self.block_size = tokens, block_size
        self.starts = _fixed_starts(len(tokens), block_size, limit)
        self._offsets = np.arange(block_size + 1)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.from_numpy(self.tokens[self.starts[i] + self._offsets].astype(np.int64))


class FixedWindowBatches(Dataset):
    """The windows of :class:`FixedWindows`, as whole batches of :class:`~lmlab.api.Windows` (item i is
    batch i, so its labels and random stream are fixed: every evaluation scores the same choices)."""

    def __init__(self, tokens: np.ndarray, block_size: int, batch_size: int, seed: int,
                 limit: int | None = None, labels=None):
        self.tokens, self.batch_size, self.seed, self.labels = tokens, batch_size, seed, labels
        self.starts = _fixed_starts(len(tokens), block_size, limit)
        self._offsets = np.arange(block_size + 1)

    def __len__(self) -> int:
        return math.ceil(len(self.starts) / self.batch_size)

    def __getitem__(self, i: int) -> Windows:
        positions = self.starts[i * self.batch_size:(i + 1) * self.batch_size, None] + self._offsets
        return Windows(torch.from_numpy(self.tokens[positions].astype(np.int64)),
                       labels=_labels(self.labels, positions), seed=stream_seed(self.seed, VAL_DRAWS, i))


def document_spans(tokens, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(starts, ends) int64 of the non-empty documents of a split whose documents begin at ``starts``."""
    starts = np.asarray(starts, dtype=np.int64)
    ends = np.append(starts[1:], len(tokens)).astype(np.int64)
    keep = ends > starts
    return starts[keep], ends[keep]


def padded_rows(tokens, starts: np.ndarray, ends: np.ndarray, length: int, labels=None,
                pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """One document per row from its first token: (tokens (B, length) int64, labels or None, padding
    (B, length) bool). A document longer than ``length`` is truncated; a shorter one is padded with
    ``pad_id``, and its labels there are 0."""
    positions = starts[:, None] + np.arange(length)  # (B, L)
    padding = positions >= ends[:, None]
    positions = np.minimum(positions, ends[:, None] - 1)  # every index stays inside its own document
    ids = tokens[positions].astype(np.int64)
    ids[padding] = pad_id
    marks = None
    if labels is not None:
        marks = np.array(labels(positions), dtype=np.uint8)
        marks[padding] = 0
        marks = torch.from_numpy(marks)
    return torch.from_numpy(ids), marks, torch.from_numpy(padding)


class RandomDocuments(EndlessBatches):
    """Endless batches of :class:`~lmlab.api.Windows`, one training document per row (padded).

    Documents come in a fresh random order each epoch (a permutation seeded by (seed, epoch)), so
    every document is seen once per epoch; batch ``i`` takes the global sample numbers
    ``[i·G, (i+1)·G)`` of that endless sequence (G the global batch), which keeps a batch a pure
    function of (seed, step) and lets each data-parallel replica take its slice.
    """

    def __init__(self, tokens, document_starts: np.ndarray, block_size: int, batch_size: int, seed: int,
                 replica: int = 0, replicas: int = 1, start: int = 0, labels=None, pad_id: int = 0,
                 accum: int = 1, curriculum=None, weights: np.ndarray | None = None):
        self.tokens = tokens
        self.starts, self.ends = document_spans(tokens, document_starts)
        if len(self.starts) == 0:
            raise ValueError("the training split has no documents")
        self.length, self.batch_size, self.seed = block_size + 1, batch_size, seed
        self.replica, self.replicas, self.start, self.accum = replica, replicas, start, accum
        self.labels, self.pad_id = labels, pad_id
        self.curriculum = curriculum  # lmlab.train.curriculum.Schedule over these documents, or None
        self.weights = weights  # (n,) per non-empty document: draws in proportion to them, or None
        self._orders: dict[int, np.ndarray] = {}

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            if len(self._orders) > 2:  # a batch spans few epochs; keep only recent permutations
                self._orders.pop(min(self._orders))
            self._orders[epoch] = np.random.default_rng([self.seed, EPOCH_ORDER, epoch]).permutation(len(self.starts))
        return self._orders[epoch]

    def documents(self, index: int) -> np.ndarray:
        """(B,) indices of this replica's documents in micro-batch ``index``."""
        step, first, total = self.slot(index)
        pool = self.curriculum.pool(step) if self.curriculum is not None else None  # e.g. the easiest documents
        if pool is not None or self.weights is not None:
            pool = np.arange(len(self.starts)) if pool is None else pool
            rng = np.random.default_rng([self.seed, CURRICULUM_DRAWS, step])
            if self.weights is None:  # without repeats while there are enough
                drawn = rng.choice(len(pool), size=total, replace=total > len(pool))
            else:  # in proportion to the weights, so with repeats
                p = self.weights[pool].astype(np.float64)
                drawn = rng.choice(len(pool), size=total, replace=True, p=p / p.sum())
            return pool[drawn[first:first + self.batch_size]]
        samples = step * total + first + np.arange(self.batch_size)
        epochs, within = np.divmod(samples, len(self.starts))
        out = np.empty(self.batch_size, dtype=np.int64)
        for epoch in np.unique(epochs):
            where = epochs == epoch
            out[where] = self._order(int(epoch))[within[where]]
        return out

    def batch(self, index: int) -> Windows:
        docs = self.documents(index)
        tokens, labels, padding = padded_rows(self.tokens, self.starts[docs], self.ends[docs], self.length,
                                              self.labels, self.pad_id)
        return self._windows(tokens, index, labels=labels, padding=padding)


class FixedDocuments(Dataset):
    """Every validation document once, in order (``limit``: an evenly spread subset), one per row,
    truncated to block_size + 1 tokens and padded; item i is batch i."""

    def __init__(self, tokens, document_starts: np.ndarray, block_size: int, batch_size: int, seed: int,
                 limit: int | None = None, labels=None, pad_id: int = 0):
        self.tokens = tokens
        starts, ends = document_spans(tokens, document_starts)
        if len(starts) == 0:
            raise ValueError("the validation split has no documents")
        chosen = _spread(np.arange(len(starts)), limit)
        self.starts, self.ends = starts[chosen], ends[chosen]
        self.length, self.batch_size, self.seed = block_size + 1, batch_size, seed
        self.labels, self.pad_id = labels, pad_id

    def __len__(self) -> int:
        return math.ceil(len(self.starts) / self.batch_size)

    def __getitem__(self, i: int) -> Windows:
        rows = slice(i * self.batch_size, (i + 1) * self.batch_size)
        tokens, labels, padding = padded_rows(self.tokens, self.starts[rows], self.ends[rows], self.length,
                                              self.labels, self.pad_id)
        return Windows(tokens, labels=labels, padding=padding, seed=stream_seed(self.seed, VAL_DRAWS, i))
