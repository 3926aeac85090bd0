"""The one-token decode step as a captured CUDA graph, replayed over the contiguous cache.

A decode step of a small model is mostly kernel launches: dozens per layer, each a few microseconds
of CPU time for microseconds of GPU work. Capturing the step once (``torch.cuda.graph``) and
replaying it launches them all at once. A graph fixes every shape and address, so the step runs over
all of the cache's rows and its whole length, with static input buffers and a key mask that hides
the positions each row has not reached; rows that are free write into their first position, which
the next prompt to take the row overwrites.
"""

import torch

from lmlab.generation.kv import Plan


class GraphedStep:
    """Replays ``model(tokens (N, 1))`` over every row of ``engine``'s contiguous store."""

    def __init__(self, engine):
        self.engine = engine
        store = engine.store
        n, length = store.rows, store.max_len
        device = engine.device
        self.tokens = torch.zeros(n, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, 1, dtype=torch.long, device=device)
        self.key_mask = torch.zeros(n, 1, 1, length, dtype=torch.bool, device=device)
        self.keys = torch.arange(length, device=device)
        self.plan = Plan(torch.arange(n, device=device), self.positions, length, leading=True)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None

    def _run(self) -> torch.Tensor:
        cache = self.engine.cache
        cache.positions, cache.key_mask, cache.length = self.positions, self.key_mask, 0
        self.engine.store.plan = self.plan
        return self.engine.model(self.tokens, cache=cache)

    def _capture(self) -> None:
        # Warm up on a side stream (as torch.cuda.graphs asks) so lazy initialisation is not captured.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._run()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._run()

    def __call__(self, rows: list[int], tokens: torch.Tensor, starts: list[int]) -> torch.Tensor:
        index = torch.tensor(rows, dtype=torch.long, device=self.tokens.device)
        self.tokens.zero_()
        self.positions.zero_()
        self.tokens[index] = tokens
        self.positions[index, 0] = torch.tensor(starts, dtype=torch.long, device=self.tokens.device)
        self.key_mask.copy_((self.keys[None, :] <= self.positions)[:, None, None, :])
        if self.graph is None:
            self._capture()
        self.graph.replay()
        return self.logits.index_select(0, index).float()
