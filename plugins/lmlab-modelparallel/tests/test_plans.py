"""The tensor-parallel plans of the first-party attention and ffn plugins (lmlab-attention, lmlab-ffn),
applied over two processes; their single-process properties are tested beside them."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.exclusive  # several processes at once


def test_each_plan_on_two_processes_computes_what_the_unsharded_module_computes(tmp_path):
    # Outputs, input gradients, every parameter after one SGD step, parameter names, and a
    # single-device state dict loaded into the shards.
    out = tmp_path / "plans.json"
    script = Path(__file__).with_name("dist_plans.py")
    result = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(out.read_text())
    assert len(report) == 6
    for case, found in report.items():
        assert found["same_names"], case
        # Measured: at most 6e-6 on outputs and gradients of about 1 (float32 summation order).
        for what in ("output", "input_grad", "after_step", "reloaded"):
            assert found[what] < 1e-4, (case, what, found[what])
