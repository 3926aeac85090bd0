"""lmlab.train.allocator: glibc's malloc thresholds for training, in a fresh process each (they are
process-wide), and the user's own glibc settings left alone."""

import os
import platform
import subprocess
import sys
import textwrap

import pytest

LIBC, LIBC_VERSION = platform.libc_ver()
pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or LIBC != "glibc" or tuple(map(int, LIBC_VERSION.split(".")[:2])) < (2, 33),
    reason="glibc's malloc, 2.33 or later (mallinfo2)")

# glibc's own accounting (mallinfo2): hblks counts blocks served as separate mappings, arena the bytes
# of the heap. A MiB-sized block, the size of a step's activations, is mapped afresh with glibc's
# initial thresholds; tuned, it comes from the heap, and 24 such blocks freed stay there for the next
# step instead of going back to the system. (bench/allocator.py measures the page faults of real steps.)
PROBE = textwrap.dedent("""
    import ctypes, sys
    from lmlab.train import allocator
    class Info(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in
                    "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype, libc.malloc.restype = Info, ctypes.c_void_p
    libc.malloc.argtypes, libc.free.argtypes = [ctypes.c_size_t], [ctypes.c_void_p]
    print(allocator.tune_for_training() if sys.argv[1] == "tune" else None)
    mapped = libc.mallinfo2().hblks
    block = libc.malloc(2 ** 20)
    print(libc.mallinfo2().hblks - mapped)
    libc.free(block)
    blocks = [libc.malloc(2 ** 20) for _ in range(24)]
    for block in blocks:
        libc.free(block)
    print(libc.mallinfo2().arena >> 20)
""")


def probe(mode: str, **env: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True,
                         env={**os.environ, **env}).stdout
    return out.splitlines()


def test_tuned_malloc_keeps_a_steps_blocks_in_the_heap():
    setting, mapped, heap_mib = probe("tune")
    assert setting.startswith("glibc: mmap threshold 32 MiB") and int(mapped) == 0 and int(heap_mib) >= 24
    _, mapped_default, heap_mib_default = probe("default")
    assert int(mapped_default) == 1  # glibc's initial mmap threshold is 128 KiB
    assert int(heap_mib_default) < 24


def test_the_users_own_glibc_settings_stand():
    setting, mapped, _ = probe("tune", MALLOC_TRIM_THRESHOLD_="131072")
    assert setting == "None" and int(mapped) == 1


def test_a_run_records_the_malloc_setting_with_its_environment():
    from lmlab import provenance
    from lmlab.train import allocator
    assert provenance.environment(device=False)["malloc"] == allocator.setting() is not None
