"""Engines: sequences of different lengths decoded together over one model (``lmlab.api.Engine``).

:class:`Engine` keeps every row in a shared key/value store (``lmlab.generation.kv``): each forward
pass feeds any subset of rows, each from its own position, with per-row positions and a key mask
that holds causality and each row's length (``MixerContext.key_mask``, API 1.8). When all rows fed
hold the same number of tokens the pass is the ordinary one (shared positions, no mask), as fast as
a plain KV-cache loop. :class:`RowEngine` serves models whose attention keeps its own state (a
recurrent mixer, a plugin without ``kv_layout``): one row at a time, each through the model's own
cache, sliding its window as ``lmlab.api.Stepper`` does.
"""

import copy

import torch

from lmlab.api.cache import InferenceCache
from lmlab.generation.kv import ContiguousKV, PagedKV, Plan

CACHES = ("contiguous", "paged")


def supports_rows(model) -> bool:
    """Whether every block's mixer gives a kv_layout and the position scheme takes per-row positions."""
    blocks = getattr(model, "blocks", None)
    if blocks is None or not getattr(model.position, "per_row", False):
        return False
    return all(b.attn.kv_layout() is not None for b in blocks)


def make_engine(model, rows: int, max_len: int, cache: str = "contiguous", block_size: int = 16,
                n_blocks: int | None = None, cuda_graph: bool = False, compile: bool = False):
    """The engine for ``model``: the model's own (``model.make_engine``, API 1.18) when it has one, else
    :class:`Engine` when its plugins support shared caches, else :class:`RowEngine`."""
    if cache not in CACHES:
        raise ValueError(f"cache must be one of {CACHES}, got {cache!r}")
    own = getattr(model, "make_engine", None)
    if own is not None:  # decoding that needs more than the shared store (None: not this time)
        engine = own(rows, max_len, cache=cache, block_size=block_size, n_blocks=n_blocks, cuda_graph=cuda_graph,
                     compile=compile)
        if engine is not None:
            return engine
    if supports_rows(model):
        return Engine(model, rows, max_len, cache=cache, block_size=block_size, n_blocks=n_blocks,
                      cuda_graph=cuda_graph, compile=compile)
    return RowEngine(model, max_len)


class _Rows(InferenceCache):
    """What the model's forward receives: every layer's view of the store, this pass's positions and mask."""

    def __init__(self, states):
        super().__init__(states, 0)
        self.positions: torch.Tensor | None = None
        self.key_mask: torch.Tensor | None = None


class Engine:
    """Up to ``rows`` sequences of up to ``max_len`` tokens (capped at the model's context).

    Plugins subclass it as ``lmlab.api.decoding.SharedCacheEngine`` (a model's own engine, API 1.18);
    what a subclass may use and override: ``model``, ``device``, ``free_rows`` (rows not in use; ``add``
    pops from it), ``history`` (each row's tokens fed so far), ``cache`` (what the model's forward
    receives: a subclass may set attributes of its own on it around a pass) and ``forward_rows`` (one
    forward pass of some rows, each from its own position; every pass goes through it). The one-token
    static step (``cuda_graph``, ``compile``) knows only the shared store: a subclass whose model reads
    more from ``cache`` turns both settings off before calling ``__init__``.
    """

    def __init__(self, model, rows: int, max_len: int, cache: str = "contiguous", block_size: int = 16,
                 n_blocks: int | None = None, cuda_graph: bool = False, compile: bool = False):
        self.model = model
        self.vocab_size = model.vocab_size
        self.settings = dict(rows=rows, max_len=max_len, cache=cache, block_size=block_size, n_blocks=n_blocks,
                             cuda_graph=cuda_graph, compile=compile)
        limit = model.max_context
        self.window = max_len if limit is None else min(max_len, limit)
        p = model.head.weight
        self.device = p.device
        layouts = [b.attn.kv_layout() for b in model.blocks]
        if cache == "paged":
            self.store = PagedKV(layouts, rows, self.window, p.device, p.dtype, block_size=block_size,
                                 n_blocks=n_blocks)
        else:
            self.store = ContiguousKV(layouts, rows, self.window, p.device, p.dtype)
        self.cache = _Rows(self.store.views)
        self.lengths = [0] * rows
        self.history: list[list[int]] = [[] for _ in range(rows)]
        self.free_rows = list(range(rows - 1, -1, -1))
        self._arange = torch.arange(self.window + 1, device=self.device)
        # The one-token step with fixed shapes (lmlab.generation.static_step), over the contiguous cache.
        self.graphed = None
        mode = "cuda_graph" if cuda_graph and self.device.type == "cuda" else "compile" if compile else None
        if mode is not None and cache == "contiguous":
            from lmlab.generation.static_step import StaticStep

            self.graphed = StaticStep(self, mode)

    # -- the lmlab.api.Engine protocol ---------------------------------------------------------------

    def add(self, prompts: list[list[int]]) -> tuple[list[int], torch.Tensor]:
        if len(prompts) > len(self.free_rows):
            raise RuntimeError(f"{len(prompts)} new sequences, {len(self.free_rows)} free rows")
        rows = [self.free_rows.pop() for _ in prompts]
        logits = torch.empty(len(prompts), self.vocab_size, device=self.device)
        by_length: dict[int, list[int]] = {}
        for i, ids in enumerate(prompts):
            if not ids:
                raise ValueError("a prompt needs at least one token")
            by_length.setdefault(len(ids), []).append(i)
        for n, members in by_length.items():
            # Rows are fed from empty, so equal lengths share a pass; a prompt as long as the window
            # keeps its last window - 1 tokens, room for the next one.
            keep = min(n, self.window - 1)
            tokens = torch.tensor([prompts[i][-keep:] for i in members], dtype=torch.long, device=self.device)
            out = self.forward_rows([rows[i] for i in members], tokens)
            logits[members] = out[:, -1]
        for row, ids in zip(rows, prompts):
            self.history[row] = list(ids)
        return rows, logits

    def step(self, rows: list[int], tokens: torch.Tensor) -> torch.Tensor:
        T = tokens.shape[1]
        full = [i for i, row in enumerate(rows) if self.lengths[row] + T > self.window]
        if full:
            # Rows with no room left restart from their most recent tokens (the new ones included), as
            # lmlab.api.Stepper does; the others go on as usual, in one pass.
            logits = torch.empty(len(rows), T, self.vocab_size, device=self.device)
            for i in full:
                logits[i] = self._refill(rows[i], tokens[i].tolist())
            rest = [i for i in range(len(rows)) if i not in set(full)]
            if rest:
                logits[rest] = self.step([rows[i] for i in rest], tokens[rest])
            return logits
        if self.graphed is not None and T == 1 and len(rows) == self.store.rows - len(self.free_rows):
            # Every row in use steps (the static step writes every row): compiled or graphed.
            starts = [self.lengths[r] for r in rows]
            logits = self.graphed(list(rows), tokens, starts)  # (B, 1, V)
            for r, s in zip(rows, starts):
                self.lengths[r] = s + 1
        else:
            logits = self.forward_rows(list(rows), tokens)
        for row, new in zip(rows, tokens.tolist()):
            self.history[row].extend(new)
        return logits

    def rewind(self, rows: list[int], counts: list[int]) -> None:
        for row, n in zip(rows, counts):
            if n > self.lengths[row]:
                raise ValueError(f"row {row} holds {self.lengths[row]} tokens; cannot drop {n}")
            if n:
                self.lengths[row] -= n
                del self.history[row][-n:]

    def fork(self, rows: list[int]) -> list[int]:
        if len(rows) > len(self.free_rows):
            raise RuntimeError(f"{len(rows)} forks, {len(self.free_rows)} free rows")
        new = [self.free_rows.pop() for _ in rows]
        self.assign(new, rows)
        return new

    def assign(self, dst: list[int], src: list[int]) -> None:
        pairs = [(d, s) for d, s in zip(dst, src) if d != s]
        if not pairs:
            return
        dst, src = [d for d, _ in pairs], [s for _, s in pairs]
        lengths = [self.lengths[s] for s in src]
        histories = [list(self.history[s]) for s in src]
        self.store.copy(dst, src, lengths)
        for d, n, h in zip(dst, lengths, histories):
            self.lengths[d], self.history[d] = n, h

    def release(self, rows: list[int]) -> None:
        for row in rows:
            self.store.free(row)
            self.lengths[row] = 0
            self.history[row] = []
            self.free_rows.append(row)

    def length(self, row: int) -> int:
        return self.lengths[row]

    def companion(self, model):
        return make_engine(model, **self.settings)

    @property
    def compile_s(self) -> float:
        """Seconds the compiled step's first call took (compiling it, or loading it from torch's cache)."""
        return getattr(self.graphed, "compile_s", None) or 0.0

    def report(self) -> str | None:
        if not self.compile_s:
            return None
        return f"contiguous cache, step compiled in {self.compile_s:.1f} s, not counted (cache: {self.graphed.cache_dir})"

    # -- internals -----------------------------------------------------------------------------------

    @property
    def rows_free(self) -> int:
        return len(self.free_rows)

    def _refill(self, row: int, new: list[int]) -> torch.Tensor:
        """Restart ``row`` from its last ``window - 1`` tokens, ``new`` included (positions from 0
        again); the logits (T, V) after each new token."""
        keep = (self.history[row] + new)[-(self.window - 1):]
        if len(keep) < len(new):
            raise ValueError(f"{len(new)} tokens at once do not fit a window of {self.window}")
        self.store.free(row)
        self.lengths[row] = 0
        out = self.forward_rows([row], torch.tensor([keep], dtype=torch.long, device=self.device))
        self.history[row] = keep
        return out[0, -len(new):]

    def forward_rows(self, rows: list[int], tokens: torch.Tensor) -> torch.Tensor:
        """Feed tokens (B, T) to ``rows`` (B), each after the tokens it holds; logits (B, T, V) float32."""
        B, T = tokens.shape
        starts = [self.lengths[r] for r in rows]
        span = max(starts) + T
        paged = isinstance(self.store, PagedKV)
        for r, s in zip(rows, starts):
            self.store.reserve(r, s + T)
            if paged:
                self.store.make_writable(r, s, s + T)
        leading = rows == list(range(B))
        # The contiguous store reads rows 0..B-1 as slices; only other rows need an index tensor.
        row_index = None if leading and not paged else torch.tensor(rows, dtype=torch.long, device=self.device)
        if min(starts) == span - T:
            # Equal lengths: the ordinary pass, shared positions and the module's own causal mask.
            positions = self._arange[span - T:span]
            self.cache.positions, self.cache.key_mask = positions, None
            self.store.plan = Plan(row_index, positions.expand(B, T), span, leading, start=span - T)
            self.cache.length = span - T
        else:
            start = torch.tensor(starts, dtype=torch.long, device=self.device)
            positions = start[:, None] + self._arange[:T]                                  # (B, T)
            keys = self._arange[:span]
            self.cache.positions = positions
            self.cache.key_mask = (keys[None, None, :] <= positions[:, :, None])[:, None]  # (B, 1, T, S)
            if row_index is None:
                row_index = torch.arange(B, device=self.device)
            self.store.plan = Plan(row_index, positions, span, leading)
            self.cache.length = 0
        logits = self.model(tokens, cache=self.cache)
        for r, s in zip(rows, starts):
            self.lengths[r] = s + T
        return logits.float()


class _Row:
    """One sequence fed through the model's own cache, sliding its window as ``lmlab.api.Stepper``
    does: a full cache restarts from the last ``window - 1`` tokens."""

    def __init__(self, model, window: int, device):
        self.model, self.window, self.device = model, window, device
        self.cache: InferenceCache | None = None
        self.tokens: list[int] = []

    def start(self, ids: list[int]) -> torch.Tensor:
        """Logits (V,) after the prompt."""
        self.tokens = list(ids)
        return self._refill()

    def step(self, token: int) -> torch.Tensor:
        """Logits (V,) after one more token."""
        self.tokens.append(token)
        if self.cache.length >= self.window:
            return self._refill()
        return self.model(torch.tensor([[token]], device=self.device), cache=self.cache)[0, -1].float()

    def _refill(self) -> torch.Tensor:
        if len(self.tokens) >= self.window:
            self.tokens = self.tokens[-(self.window - 1):]
        self.cache = self.model.new_cache(1, self.window)
        return self.model(torch.tensor([self.tokens], device=self.device), cache=self.cache)[0, -1].float()

    def copy(self) -> "_Row":
        twin = copy.copy(self)  # shares the model
        twin.cache, twin.tokens = copy.deepcopy(self.cache), list(self.tokens)
        return twin


class RowEngine:
    """Rows fed one at a time through the model's own cache: for models whose mixers keep their own state."""

    def __init__(self, model, max_len: int):
        self.model = model
        self.vocab_size = model.vocab_size
        self.max_len = max_len
        limit = model.max_context
        self.window = max_len if limit is None else min(max_len, limit)
        self.device = next(model.parameters()).device
        self.rows: dict[int, _Row] = {}
        self._next = 0

    def _new_row(self) -> int:
        self._next += 1
        return self._next - 1

    def add(self, prompts):
        rows, logits = [], []
        for ids in prompts:
            if not ids:
                raise ValueError("a prompt needs at least one token")
            row = self._new_row()
            self.rows[row] = _Row(self.model, self.window, self.device)
            logits.append(self.rows[row].start(list(ids)))
            rows.append(row)
        return rows, torch.stack(logits)

    def step(self, rows, tokens):
        out = []
        for row, seq in zip(rows, tokens.tolist()):
            out.append(torch.stack([self.rows[row].step(t) for t in seq]))  # (T, V)
        return torch.stack(out)

    def rewind(self, rows, counts):
        if any(counts):
            raise NotImplementedError("this model's attention keeps a state that cannot drop tokens (no kv_layout); "
                                      "speculative decoding needs a key/value-cache attention plugin")

    def fork(self, rows):
        new = []
        for src in rows:
            row = self._new_row()
            self.rows[row] = self.rows[src].copy()
            new.append(row)
        return new

    def assign(self, dst, src):
        copies = [self.rows[s].copy() for s in src]
        for d, state in zip(dst, copies):
            self.rows[d] = state

    def release(self, rows):
        for row in rows:
            self.rows.pop(row, None)

    def length(self, row):
        return self.rows[row].cache.length  # as Engine's: the tokens the row's cache holds

    def companion(self, model):
        return RowEngine(model, self.max_len)
