"""Ctrl-C and SIGTERM: a message, exit 130 or 143 (so `lmlab run ... && next-step` stops), the run
recorded as interrupted, and running the same command again resumes to exactly the result of a run
that was never interrupted. SIGTERM (a scheduler's preemption) first writes a checkpoint of the step
it stopped after; under `--jobs` it is passed on to every child."""

import json
import signal

import pytest
import torch

from support import completed_run, logged_steps, run_cli, start_cli, wait_for

STEPS = 300


@pytest.fixture
def long_run(tiny_manifest, tmp_path):
    """(manifest, run arguments, the uninterrupted run's summary)."""
    path = tiny_manifest(steps=STEPS, eval_every=100, checkpoint_every=25)
    return path, ("--set", "train.sample_tokens=0"), completed_run(path, tmp_path / "ref")


@pytest.mark.parametrize("sent, status, message", [
    (signal.SIGINT, 130, "lmlab: interrupted (Ctrl-C)"),
    (signal.SIGTERM, 143, "lmlab: terminated (SIGTERM)"),
])
def test_a_signal_ends_the_run_resumably_with_its_exit_status(long_run, tmp_path, sent, status, message):
    path, args, reference = long_run
    out = tmp_path / "runs"
    proc = start_cli("run", str(path), "--out", str(out), *args)
    run_dir = out / "default"
    wait_for(lambda: max(logged_steps(run_dir / "metrics.jsonl"), default=0) >= 30, proc, what="step 30")
    proc.send_signal(sent)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == status, stderr[-2000:]
    assert stderr.rstrip().splitlines()[-1] == message
    assert "Traceback" not in stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["signal"] == signal.Signals(sent).name
    if sent == signal.SIGTERM:  # a checkpoint of the very step it stopped after
        last = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True, mmap=True)
        assert last["global_step"] == summary["steps"] >= 30
        assert f"SIGTERM: stopped after step {summary['steps']}, its checkpoint written" in stderr

    again = run_cli("run", str(path), "--out", str(out), *args)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "(resuming)" in again.stderr
    resumed = json.loads((run_dir / "summary.json").read_text())
    assert resumed["status"] == "completed" and resumed["steps"] == STEPS
    assert resumed["val_loss"] == pytest.approx(reference["val_loss"], abs=1e-5)
    assert logged_steps(run_dir / "metrics.jsonl") == list(range(2, STEPS + 1, 2))


@pytest.mark.exclusive
def test_sigterm_to_a_parallel_sweep_checkpoints_every_child_and_exits_143(tiny_manifest, tmp_path):
    path = tiny_manifest('\n[sweep]\nseeds = [1, 2]\n', steps=2000, eval_every=500, checkpoint_every=500)
    out = tmp_path / "runs"
    proc = start_cli("run", str(path), "--out", str(out), "--jobs", "2", "--set", "train.sample_tokens=0")
    variants = [out / "seed=1", out / "seed=2"]
    wait_for(lambda: all(max(logged_steps(v / "metrics.jsonl"), default=0) >= 20 for v in variants), proc,
             what="both children at step 20")
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 143, stderr[-2000:]
    for run_dir in variants:
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["status"] == "interrupted" and summary["signal"] == "SIGTERM"
        last = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True, mmap=True)
        assert last["global_step"] == summary["steps"] >= 20  # checkpointed where it stopped, not at 500
