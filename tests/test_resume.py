"""`kill -9` in the middle of a run, then `--resume`: the same final validation loss as a run that
was never interrupted, and no checkpoint is ever half-written."""

import json
import os
import signal
import subprocess
import sys
import time

import torch

STEPS = 120


def start(path, out):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "lmlab", "run", str(path), "--out", str(out)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait_for_step(metrics, step, proc, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metrics.exists():
            steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines() if line.endswith("}")]
            if steps and max(steps) >= step:
                return
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.05)
    raise AssertionError(f"no step {step} within {timeout}s")


def test_kill_9_then_resume_matches_an_uninterrupted_run(tiny_manifest, tmp_path):
    path = tiny_manifest(steps=STEPS, eval_every=40, checkpoint_every=20)
    # Dropout makes the result depend on the random stream too, which the checkpoint must carry.
    path.write_text(path.read_text().replace("block_size = 16", "block_size = 16\ndropout = 0.1"))
    reference = subprocess.run([sys.executable, "-m", "lmlab", "run", str(path), "--out", str(tmp_path / "ref"),
                                "--set", "train.sample_tokens=0"],
                               env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    assert reference.returncode == 0, reference.stderr

    out = tmp_path / "killed"
    proc = start(path, out)
    wait_for_step(out / "default" / "metrics.jsonl", 50, proc)  # past the checkpoints at 20 and 40
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    run_dir = out / "default"
    assert not (run_dir / "summary.json").exists()
    step = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]
    assert 40 <= step < STEPS  # a whole, loadable checkpoint from before the kill

    resumed = subprocess.run([sys.executable, "-m", "lmlab", "run", str(path), "--out", str(out), "--resume",
                              "--set", "train.sample_tokens=0"],
                             env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    ref = json.loads((tmp_path / "ref" / "default" / "summary.json").read_text())
    got = json.loads((run_dir / "summary.json").read_text())
    assert got["status"] == "completed" and got["steps"] == STEPS
    assert abs(got["val_loss"] - ref["val_loss"]) <= 1e-4, (got["val_loss"], ref["val_loss"])

    # metrics.jsonl reads as one run: every step logged once, in order.
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if "train_loss" in line]
    assert steps == list(range(2, STEPS + 1, 2))
