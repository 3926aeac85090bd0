"""Length-dependent checks run again past a plugin's int options (a window, a chunk, a ring buffer),
so a cache that misbehaves only once such a size fills is caught."""

import functools
from collections.abc import Callable, Iterator

from lmlab.testing.common import LONGEST_BLOCK, CheckFailed, Subject, fail


def past_length_options(check: Callable[["Subject"], None]) -> Callable[["Subject"], None]:
    """``check`` run at the subject's shape, then again at a block_size past every int option as large
    as half of it: 2 × the largest such value + 3 (at most :data:`LONGEST_BLOCK`), so a sliding window or
    chunk that the default 16 positions never fill, fills and is crossed in prefill, steps and chunks;
    then with each int option at the top of its range (:meth:`Subject.option_tops`), past it likewise."""

    @functools.wraps(check)
    def run(subject: "Subject") -> None:
        check(subject)
        for variant, where in _length_variants(subject):
            try:
                check(variant)
            except CheckFailed as exc:
                fail(f"{where}: {exc}")
            except Exception as exc:  # the plugin raised: name the length it raised at
                raise CheckFailed(f"{where}: raised {type(exc).__name__}: {exc}") from exc

    run.__doc__ = (check.__doc__ or "").rstrip() + (
        " Then again at a block_size past the plugin's int options that reach half the shape's block_size "
        f"(2 × the largest + 3, at most {LONGEST_BLOCK}), so a window or chunk of that size is exercised; and "
        "with each int option at the top of its declared or stated range, past that.")
    return run


def _length_variants(subject: "Subject") -> Iterator[tuple["Subject", str]]:
    """(subject, where) pairs a length-dependent check runs again at, after the subject itself."""
    lengths = subject.length_options()
    if lengths:
        name, value = max(lengths.items(), key=lambda item: item[1])
        longer = subject.longest_block(min(2 * value + 3, LONGEST_BLOCK))
        if longer > subject.shape.block_size:
            yield subject.at_block_size(longer), f"at block_size {longer}, past option {name} = {value}"
    for name, (top, why) in subject.option_tops().items():
        variant = subject.with_option(name, top)
        if variant is None:
            continue
        # A range the test states is the author's choice of cost: crossed whatever its length.
        cap = 2 * top + 3 if name in subject.ranges else LONGEST_BLOCK
        longer = variant.longest_block(max(subject.shape.block_size, min(2 * top + 3, cap)))
        yield variant.at_block_size(longer), f"with option {name} = {top} ({why}), at block_size {longer}"
