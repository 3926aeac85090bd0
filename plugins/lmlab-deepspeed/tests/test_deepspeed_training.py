"""ZeRO on two CPU processes (Gloo) trains what one device does on the global batch, writes
checkpoints that `lmlab generate` loads, resumes after `kill -9`, and exits cleanly."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from lmlab.testing import check_parallel_matches_single
from lmlab.testing.parallel import MANIFEST, loss_trajectory, synthetic_corpus

pytestmark = pytest.mark.exclusive  # several processes at once

TWO_CPU_PROCESSES = 'use = "deepspeed"\ndevices = 2\naccelerator = "cpu"\n'


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stage_on_two_processes_trains_exactly_what_one_device_does(stage, tmp_path):
    # Measured over 20 steps: the largest loss difference is 4.8e-7 in each stage (float32 summation
    # order: DeepSpeed reduces per-rank gradient partitions where one device sums the whole batch),
    # and the consolidated weights differ by at most 1.2e-7. A wrong average or a lost shard shows
    # as 1e-2 or more from the first step.
    check_parallel_matches_single(TWO_CPU_PROCESSES + f"stage = {stage}", tmp_path, atol=1e-5)
    single, parallel = (torch.load(tmp_path / run / "default" / "checkpoints" / "last.ckpt", weights_only=True)
                        for run in ("single", "parallel"))
    assert parallel["deepspeed"]["stage"] == stage and parallel["state_dict"].keys() == single["state_dict"].keys()
    assert max((parallel["state_dict"][k] - w).abs().max().item() for k, w in single["state_dict"].items()) <= 1e-5


def test_a_killed_run_resumes_from_its_shards_exactly_where_it_stopped_and_exits_cleanly(tmp_path):
    """Stage 3 with the optimizer offloaded: every rank's partition of the parameters and of Adam's
    state comes back from DeepSpeed's shards, the rest (step, schedule, data position) from the file."""
    corpus = synthetic_corpus(tmp_path / "corpus.txt")
    steps = 30
    text = MANIFEST.format(data=corpus, steps=steps, batch_size="{batch_size}").replace(
        f"checkpoint_every = {steps}", "checkpoint_every = 10")
    single = tmp_path / "single.toml"
    single.write_text(text.format(batch_size=8))
    parallel = tmp_path / "parallel.toml"
    parallel.write_text(text.format(batch_size=4) + f"\n[parallel]\n{TWO_CPU_PROCESSES}stage = 3\n"
                        'offload_optimizer = "cpu"\n')
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = [sys.executable, "-m", "lmlab", "run"]
    reference = subprocess.run([*run, single, "--out", tmp_path / "single"], env=env, capture_output=True, text=True)
    assert reference.returncode == 0, reference.stderr

    out = tmp_path / "parallel"
    metrics = out / "default" / "metrics.jsonl"
    # Its own session, so that the kill reaches the worker process Lightning started too.
    proc = subprocess.Popen([*run, parallel, "--out", out], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _wait_for_step(metrics, 12, proc)  # past the checkpoint at step 10
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    step = torch.load(out / "default" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]
    assert 10 <= step < steps

    resumed = subprocess.run([*run, parallel, "--out", out, "--resume"], env=env, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "(resuming)" in resumed.stderr and "terminate called" not in resumed.stderr
    assert json.loads((out / "default" / "summary.json").read_text())["steps"] == steps
    expected, actual = loss_trajectory(tmp_path / "single" / "default"), loss_trajectory(out / "default")
    assert len(actual) == steps
    assert max(abs(a - b) for a, b in zip(actual, expected)) <= 1e-5, (expected, actual)
    # The last and best checkpoints of the final step share one set of shards; older ones are gone.
    assert len([p for p in (out / "default" / "checkpoints" / "deepspeed").iterdir() if p.is_dir()]) == 1


def _wait_for_step(metrics, step, proc, timeout=300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metrics.exists():
            steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines() if line.endswith("}")]
            if steps and max(steps) >= step:
                return
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.05)
    raise AssertionError(f"no step {step} within {timeout}s")
