"""Key/value caches shared by rows of different lengths: contiguous, or paged in fixed-size blocks.

Both hold every layer's keys and values for a fixed number of rows (sequences). Before each forward
pass the engine sets a :class:`Plan` (which rows, from which position, how many tokens); every
layer's :class:`LayerKV` then writes its new keys there and returns the rows' keys so far, through
the same ``update(k, v, start)`` an attention module calls on ``lmlab.api.KVCache``.

``contiguous`` reserves ``max_len`` positions per row up front: reads are views, but a short
sequence leaves most of its reservation unused. ``paged`` keeps a pool of blocks of
``block_size`` positions and a block table per row (PagedAttention, Kwon et al. 2023,
https://arxiv.org/abs/2309.06180): a row takes blocks as it grows and gives them back when it ends,
and a forked row (beam search) shares its source's blocks until it writes into one (copy on write).
Reads gather the row's blocks, a copy per layer and step that the contiguous layout avoids.
"""

from dataclasses import dataclass

import torch


@dataclass
class Plan:
    """One forward pass: rows (B,) int64, positions (B, T) where their tokens go, S keys to return."""

    rows: torch.Tensor | None  # None: rows 0..B-1 of a contiguous store, read as slices
    positions: torch.Tensor
    span: int
    leading: bool  # rows are 0..B-1 in order: contiguous reads are views
    start: int | None = None  # every row starts here (equal lengths): slice writes, no mask


class CacheFull(RuntimeError):
    """No free block for a growing sequence."""


class LayerKV:
    """One layer's view of a store: what the attention module receives as ``state``."""

    def __init__(self, store: "KVStore", layer: int):
        self.store, self.layer = store, layer

    def update(self, k: torch.Tensor, v: torch.Tensor, start=None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.store.write_read(self.layer, k, v)

    def reorder(self, index: torch.Tensor) -> None:
        raise NotImplementedError("rows of a shared cache are copied with Engine.assign, not reordered")


class KVStore:
    """Keys and values of ``n_layers`` layers for ``rows`` sequences of up to ``max_len`` positions."""

    kind = ""

    def __init__(self, layouts: list[tuple[int, int]], rows: int, max_len: int, device, dtype):
        self.layouts, self.rows, self.max_len = layouts, rows, max_len
        self.device, self.dtype = torch.device(device), dtype
        self.plan: Plan | None = None
        self.views = [LayerKV(self, i) for i in range(len(layouts))]

    def reserve(self, row: int, length: int) -> None:
        """Make room for positions [0, length) of ``row``."""

    def free(self, row: int) -> None:
        """Row ``row`` has ended."""

    def copy(self, dst: list[int], src: list[int], length: list[int]) -> None:
        """Rows dst[i] := rows src[i] (their first length[i] positions), all read before any is written."""
        raise NotImplementedError

    def write_read(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def reserved_positions(self) -> int:
        """Positions of memory set aside now, for the utilisation figure (stored tokens / reserved)."""
        raise NotImplementedError


class ContiguousKV(KVStore):
    """(rows, n_kv_heads, max_len, head_dim) per layer, allocated once."""

    kind = "contiguous"

    def __init__(self, layouts, rows, max_len, device, dtype):
        super().__init__(layouts, rows, max_len, device, dtype)
        self.k = [torch.zeros(rows, h, max_len, d, device=device, dtype=dtype) for h, d in layouts]
        self.v = [torch.zeros_like(k) for k in self.k]

    def write_read(self, layer, k, v):
        p = self.plan
        K, V = self.k[layer], self.v[layer]
        B = p.positions.shape[0]
        if p.leading and p.start is not None:  # the common case (one prompt, or equal lengths): plain slices
            K[:B, :, p.start:p.span] = k
            V[:B, :, p.start:p.span] = v
            return K[:B, :, :p.span], V[:B, :, :p.span]
        # Advanced indices on dims 0 and 2 put (B, T) first: the new (B, H, T, d) goes in as (B, T, H, d).
        K[p.rows[:, None], :, p.positions] = k.transpose(1, 2).to(K.dtype)
        V[p.rows[:, None], :, p.positions] = v.transpose(1, 2).to(V.dtype)
        if p.leading:
            return K[:B, :, :p.span], V[:B, :, :p.span]
        return K[:, :, :p.span].index_select(0, p.rows), V[:, :, :p.span].index_select(0, p.rows)

    def copy(self, dst, src, length):
        d = torch.tensor(dst, device=self.device)
        s = torch.tensor(src, device=self.device)
        n = max(length, default=0)
        for K, V in zip(self.k, self.v):
            K[d, :, :n] = K[s, :, :n]  # the right side is gathered before the write
            V[d, :, :n] = V[s, :, :n]

    def reserved_positions(self) -> int:
        return self.rows * self.max_len


class PagedKV(KVStore):
    """A pool of (n_blocks, block_size, n_kv_heads, head_dim) per layer and a block table per row.

    Positions before heads: a row's gathered blocks (B, n, block_size, H, d) are then its keys in
    order, one reshape away from (B, S, H, d), which attention reads transposed without a copy."""

    kind = "paged"

    def __init__(self, layouts, rows, max_len, device, dtype, block_size: int = 16, n_blocks: int | None = None):
        super().__init__(layouts, rows, max_len, device, dtype)
        self.block_size = block_size
        self.per_row = -(-max_len // block_size)
        # By default as many blocks as a contiguous cache's positions: the same worst case, but rows
        # take only what they use, so more of them fit (the server admits by free blocks).
        self.n_blocks = n_blocks if n_blocks is not None else rows * self.per_row
        self.k = [torch.zeros(self.n_blocks, block_size, h, d, device=device, dtype=dtype) for h, d in layouts]
        self.v = [torch.zeros_like(k) for k in self.k]
        self.free_blocks = list(range(self.n_blocks - 1, -1, -1))
        self.refs = [0] * self.n_blocks
        self.blocks: list[list[int]] = [[] for _ in range(rows)]
        # Unused entries point at block 0: gathered with the rest, then masked.
        self.table = torch.zeros(rows, self.per_row, dtype=torch.long, device=device)

    def blocks_for(self, length: int) -> int:
        return -(-length // self.block_size)

    def available(self) -> int:
        return len(self.free_blocks)

    def _take(self) -> int:
        if not self.free_blocks:
            raise CacheFull(f"all {self.n_blocks} blocks of {self.block_size} positions are in use")
        b = self.free_blocks.pop()
        self.refs[b] = 1
        return b

    def _drop(self, b: int) -> None:
        self.refs[b] -= 1
        if self.refs[b] == 0:
            self.free_blocks.append(b)

    def reserve(self, row, length):
        blocks = self.blocks[row]
        first = len(blocks)
        while len(blocks) < self.blocks_for(length):
            blocks.append(self._take())
        if len(blocks) > first:
            self.table[row, first:len(blocks)] = torch.tensor(blocks[first:], device=self.device)

    def make_writable(self, row: int, start: int, end: int) -> None:
        """Copy-on-write: blocks of ``row`` covering [start, end) that another row shares get a copy."""
        blocks = self.blocks[row]
        for i in range(start // self.block_size, self.blocks_for(end)):
            b = blocks[i]
            if self.refs[b] > 1:
                fresh = self._take()
                for K, V in zip(self.k, self.v):
                    K[fresh] = K[b]
                    V[fresh] = V[b]
                self.refs[b] -= 1
                blocks[i] = fresh
                self.table[row, i] = fresh

    def free(self, row):
        for b in self.blocks[row]:
            self._drop(b)
        self.blocks[row] = []

    def copy(self, dst, src, length):
        # Sharing, not copying: the destination takes references to the source's blocks.
        chosen = [list(self.blocks[s][:self.blocks_for(n)]) for s, n in zip(src, length)]
        for blocks in chosen:
            for b in blocks:
                self.refs[b] += 1
        for row, blocks in zip(dst, chosen):
            self.free(row)
            self.blocks[row] = blocks
            if blocks:
                self.table[row, :len(blocks)] = torch.tensor(blocks, device=self.device)

    def write_read(self, layer, k, v):
        p = self.plan
        K, V = self.k[layer], self.v[layer]
        bs = self.block_size
        table = self.table.index_select(0, p.rows)                                    # (B, per_row)
        block = table.gather(1, p.positions // bs)                                     # (B, T)
        offset = p.positions % bs
        K[block, offset] = k.transpose(1, 2).to(K.dtype)                               # (B, T, H, d)
        V[block, offset] = v.transpose(1, 2).to(V.dtype)
        n = self.blocks_for(p.span)
        B, h, d = table.shape[0], K.shape[2], K.shape[3]
        used = table[:, :n]
        keys = K[used].view(B, n * bs, h, d)[:, :p.span].transpose(1, 2)              # (B, H, S, d)
        values = V[used].view(B, n * bs, h, d)[:, :p.span].transpose(1, 2)
        return keys, values

    def reserved_positions(self) -> int:
        return (self.n_blocks - len(self.free_blocks)) * self.block_size
