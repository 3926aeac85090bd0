"""Whether ``--max-batch`` rows of key/value cache fit in the memory of the model's device.

The engine allocates its whole cache up front (every row's worst case: the context), so a batch too
large for the machine fails inside the allocator; this sizes it first and refuses it in one line.
"""

import os
from pathlib import Path

import torch

from lmlab.errors import UserError
from lmlab.generation.engine import supports_rows

# The cache may take at most this share of the free memory: the forward passes need the rest.
SHARE = 0.9
# Bookkeeping per row besides the cache (its block table, history list, length, free-row entry).
ROW_OVERHEAD = 256


def cache_bytes(model, rows: int, context: int, cache: str, block_size: int, n_blocks: int | None) -> int:
    """Bytes of key/value cache the engine allocates for ``rows`` sequences of ``context`` tokens (0 for a
    model that keeps its own per-row state, which grows only with the requests admitted)."""
    if not supports_rows(model):
        return 0
    per_position = sum(2 * h * d for h, d in (b.attn.kv_layout() for b in model.blocks))
    per_position *= model.head.weight.element_size()
    if cache == "paged":
        per_row = -(-context // block_size)
        positions = (n_blocks if n_blocks is not None else rows * per_row) * block_size
    else:
        positions = rows * context
    return positions * per_position


def free_bytes(device: torch.device) -> int | None:
    """Memory free for new tensors on ``device`` (None when it cannot be told)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_fits(model, rows: int, context: int, cache: str, block_size: int, n_blocks: int | None) -> None:
    """A UserError naming --max-batch when its cache would not fit in the device's free memory."""
    need = cache_bytes(model, rows, context, cache, block_size, n_blocks) + rows * ROW_OVERHEAD
    device = model.head.weight.device
    free = free_bytes(device)
    if free is None or need <= SHARE * free:
        return
    per_row = cache_bytes(model, 1, context, cache, block_size, None) + ROW_OVERHEAD
    fits = int(SHARE * free // per_row)
    raise UserError(f"{rows} requests of up to {context} tokens need {_size(need)} of key/value cache, but "
                    f"{_size(free)} of {device.type} memory is free; at most {fits} fit", key="--max-batch")


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
        n /= 1024
