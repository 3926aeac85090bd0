"""The one-token decode step with fixed shapes: compiled (``torch.compile``) or captured as a CUDA graph.

A decode step of a small model is mostly overhead: dozens of operations per layer, each a few
microseconds of dispatch (and on a GPU, a kernel launch) for microseconds of work. Given fixed
shapes, the step can be compiled once into fused kernels (``torch.compile``, on any device) or
captured once and replayed as a CUDA graph. So the step runs over all of the cache's rows and its
whole length, with static input buffers and a key mask that hides the positions each row has not
reached; rows that are free write into their first position, which the next prompt to take the row
overwrites.
"""

import time

import torch

from lmlab.generation.kv import Plan

MODES = ("compile", "cuda_graph")


class StaticStep:
    """``model(tokens (N, 1))`` over every row of ``engine``'s contiguous store, compiled or graphed."""

    def __init__(self, engine, mode: str):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.engine, self.mode = engine, mode
        store = engine.store
        n, length = store.rows, store.max_len
        device = engine.device
        self.tokens = torch.zeros(n, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, 1, dtype=torch.long, device=device)
        self.key_mask = torch.zeros(n, 1, 1, length, dtype=torch.bool, device=device)
        self.keys = torch.arange(length, device=device)
        self.plan = Plan(torch.arange(n, device=device), self.positions, length, leading=True)
        self.graph = None
        self.logits: torch.Tensor | None = None
        # dynamic=False: one specialisation for the fixed shapes, compiled on the first step, whose
        # time (the compilation, or loading it from torch's cache) is compile_s.
        self.compiled = None
        self.compile_s: float | None = None
        if mode == "compile":
            from lmlab.compile_cache import use_compile_cache

            self.cache_dir = use_compile_cache()
            self.compiled = torch.compile(self._run, dynamic=False)

    def _run(self) -> torch.Tensor:
        cache = self.engine.cache
        # A fresh view each pass: positions are a new object per forward (MixerContext.positions).
        cache.positions, cache.key_mask, cache.length = self.positions[:], self.key_mask, 0
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
        if self.compiled is not None:
            started = time.perf_counter()
            logits = self.compiled()
            if self.compile_s is None:  # the first call: compiling, or loading from torch's cache
                self.compile_s = time.perf_counter() - started
        else:
            if self.graph is None:
                self._capture()
            self.graph.replay()
            logits = self.logits
        return logits.index_select(0, index).float()
