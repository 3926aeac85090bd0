"""The order in which the kit feeds a sequence to a cached decoder: prefill, single steps and chunks."""

from collections.abc import Iterable


def decoding_schedule(length: int, marks: Iterable[int] = ()) -> list[tuple[int, int, str]]:
    """(start, end, kind) pieces covering [0, length) as a decoder feeds them: a prefill, single
    steps, a multi-token chunk after the cache already holds tokens, a step and a last chunk; and
    single steps at positions m - 1, m, m + 1, 2m and 2m + 1 for each mark m (an option's value), so a
    cache is stepped through where a window of that size fills and wraps, not only chunked past it."""
    pieces, start = [], max(1, length // 3)
    pieces.append((0, start, "prefill"))
    for _ in range(3):
        if start < length:
            pieces.append((start, start + 1, "single step"))
            start += 1
    chunk = max(2, (length - start) // 2)
    for kind, size in (("chunk", chunk), ("single step", 1), ("chunk", length)):
        end = min(length, start + size)
        if start < end:
            pieces.append((start, end, kind if end - start > 1 else "single step"))
            start = end
    steps = {p for m in marks for p in (m - 1, m, m + 1, 2 * m, 2 * m + 1) if 0 < p < length}
    split = []
    for start, end, kind in pieces:
        for p in sorted(q for q in steps if start <= q < end):
            if start < p:
                split.append((start, p, kind if p - start > 1 else "single step"))
            split.append((p, p + 1, "single step"))
            start = p + 1
        if start < end:
            split.append((start, end, kind if end - start > 1 else "single step"))
    return split
