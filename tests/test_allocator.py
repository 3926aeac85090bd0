"""lmlab.train.allocator: glibc's malloc thresholds for training, in a fresh process each (they are
process-wide), and the user's own glibc settings left alone."""

import platform
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="glibc's malloc only")

# A training step's allocations: a small MLP stack's forward and backward passes on (12, 64, ·)
# activations, MiB-sized tensors allocated and freed in autograd's order; printed are the minor page
# faults of the last 20 steps (first touches of fresh pages).
PROBE = textwrap.dedent("""
    import resource, sys, torch
    from lmlab.train import allocator
    print(allocator.tune_for_training() if sys.argv[1] == "tune" else None)
    torch.manual_seed(0)
    layers = [torch.nn.Linear(128, 512), torch.nn.Linear(512, 128)] * 2
    x = torch.randn(12, 64, 128)
    def steps(n):
        for _ in range(n):
            h = x
            for i in range(0, 4, 2):
                h = h + layers[i + 1](torch.nn.functional.gelu(layers[i](h)))
            h.square().mean().backward()
    steps(5)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    steps(20)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


def probe(mode: str, **env: str) -> tuple[str, int]:
    import os
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True,
                         env={**os.environ, **env}).stdout.split("\n")
    return out[0], int(out[1])


def test_tuned_malloc_reuses_the_blocks_a_step_frees_instead_of_faulting_in_fresh_pages():
    setting, faults = probe("tune")
    assert setting.startswith("glibc: mmap threshold 32 MiB")
    _, faults_default = probe("default")
    # Measured here: about 10,800 faults in 20 steps with glibc's own thresholds, about 200 tuned.
    assert faults_default > 20 * 100
    assert faults < faults_default / 10


def test_the_users_own_glibc_settings_stand():
    setting, _ = probe("tune", MALLOC_TRIM_THRESHOLD_="131072")
    assert setting == "None"


def test_a_run_records_the_malloc_setting_with_its_environment():
    from lmlab import provenance
    from lmlab.train import allocator
    assert provenance.environment(device=False)["malloc"] == allocator.setting() is not None
