"""Token windows for training (random) and validation (fixed).

A training batch is a pure function of (seed, micro-step): the *global* batch of all data-parallel
replicas is drawn at once and each replica takes its slice. A resumed run therefore sees exactly the
batches the interrupted one would have, and a run on N data-parallel replicas with batch_size B sees
the same data, in the same order, as a single device with batch_size N·B: the two are comparable
step by step (the parallel strategies' tests rely on it).
"""

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset


class RandomWindows(IterableDataset):
    """Endless batches (B, T+1) of windows starting at uniformly random offsets (nanoGPT's get_batch)."""

    def __init__(self, tokens: np.ndarray, block_size: int, batch_size: int, seed: int,
                 replica: int = 0, replicas: int = 1, start: int = 0):
        if len(tokens) <= block_size + 1:
            raise ValueError(f"the training split has {len(tokens)} tokens; block_size {block_size} needs more")
        self.tokens, self.block_size, self.batch_size = tokens, block_size, batch_size
        self.seed, self.replica, self.replicas, self.start = seed, replica, replicas, start
        self._offsets = np.arange(block_size + 1)

    def batch(self, index: int) -> torch.Tensor:
        rng = np.random.default_rng([self.seed, 0, index])
        starts = rng.integers(0, len(self.tokens) - self.block_size - 1, size=self.batch_size * self.replicas)
        mine = starts[self.replica * self.batch_size:(self.replica + 1) * self.batch_size]
        return torch.from_numpy(self.tokens[mine[:, None] + self._offsets].astype(np.int64))

    def __iter__(self):
        index = self.start
        while True:
            yield self.batch(index)
            index += 1


class FixedWindows(Dataset):
    """Consecutive non-overlapping windows (T+1 tokens, stride T) covering the whole split.

    ``limit`` keeps a fixed, evenly spread subset (periodic evaluation); None keeps every window
    (the final evaluation, over the whole validation split).
    """

    def __init__(self, tokens: np.ndarray, block_size: int, limit: int | None = None):
        self.tokens, self.block_size = tokens, block_size
        starts = np.arange(0, len(tokens) - block_size, block_size)
        if len(starts) == 0:
            raise ValueError(f"the validation split has {len(tokens)} tokens; block_size {block_size} needs more")
        if limit is not None and limit < len(starts):
            starts = starts[np.linspace(0, len(starts) - 1, limit).round().astype(np.int64)]
        self.starts = starts
        self._offsets = np.arange(block_size + 1)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.from_numpy(self.tokens[self.starts[i] + self._offsets].astype(np.int64))
