"""glibc's malloc set up for a training loop: the step's tensors reuse memory instead of fresh pages.

PyTorch takes CPU tensors straight from malloc. A training step allocates and frees the same
activations and gradients every step, most of them from a few hundred KiB to a few MiB. glibc serves
blocks above its mmap threshold (128 KiB at first, raised as such blocks are freed) as new mappings,
and hands free memory at the top of its heap back to the system past its trim threshold; either way
many of those blocks come back as new pages, which the kernel must fault in and zero on first touch.
Fixing the thresholds at 32 MiB (the most glibc's own adjustment would ever reach) and 64 MiB keeps
the step's blocks in the heap, where the next step finds them: ``bench/allocator.py`` measures the
page faults and the step time of the quickstart model with and without.

Where it does nothing: not glibc (macOS, musl, a preloaded jemalloc or tcmalloc: mallopt then sets a
malloc nobody uses), and when the user set glibc's own variables (MALLOC_MMAP_THRESHOLD_,
MALLOC_TRIM_THRESHOLD_, MALLOC_TOP_PAD_, MALLOC_MMAP_MAX_), whose choice stands.
"""

import ctypes
import ctypes.util
import os
import platform

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD = 32 * 2 ** 20
TRIM_THRESHOLD = 64 * 2 ** 20
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def setting() -> str | None:
    """What :func:`tune_for_training` sets in this process's environment, or None where it does nothing
    (recorded with a run's environment)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    if any(name in os.environ for name in USER_SETTINGS):
        return None
    return f"glibc: mmap threshold {MMAP_THRESHOLD >> 20} MiB, trim threshold {TRIM_THRESHOLD >> 20} MiB"


def tune_for_training() -> str | None:
    """Set glibc's thresholds (process-wide; once is enough); returns :func:`setting`, or None where it
    does nothing."""
    described = setting()
    if described is None:
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if not (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        return None  # mallopt returns 0 when it refuses a value
    return described
