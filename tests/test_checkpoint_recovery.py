"""Damaged checkpoints never stop a run for good, and never cost a good one: resuming falls back to the
newest readable checkpoint (or starts over, saying why), `generate` falls back from best.ckpt to
last.ckpt, `[init]` names the unreadable file, a checkpoint that does not read back never replaces
the previous one, and checkpoints are staged inside the run folder, not in $TMPDIR."""

import json
import os
import signal
import tempfile

import pytest
import torch

from lmlab import manifest
from lmlab.train import runner
from lmlab.train.checkpoint_io import RunFolderCheckpointIO
from support import completed_run, logged_steps, run_cli, start_cli, wait_for

STEPS = 120


@pytest.fixture
def recovering(tiny_manifest, tmp_path):
    """(manifest, the reference run's folder, a run killed after step 55 with checkpoints at 50 and best at 40)."""
    path = tiny_manifest(steps=STEPS, eval_every=20, checkpoint_every=10)
    completed_run(path, tmp_path / "ref")
    killed = start_cli("run", str(path), "--out", str(tmp_path / "runs"), "--set", "train.sample_tokens=0")
    run_dir = tmp_path / "runs" / "default"
    wait_for(lambda: max(logged_steps(run_dir / "metrics.jsonl"), default=0) >= 56, killed, what="step 56")
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    return path, tmp_path / "ref" / "default", run_dir


def step_of(path) -> int:
    return torch.load(path, weights_only=True, mmap=True)["global_step"]


def test_a_truncated_last_checkpoint_resumes_from_best_and_ends_as_the_uninterrupted_run(recovering):
    path, reference, run_dir = recovering
    last, best = run_dir / "checkpoints" / "last.ckpt", run_dir / "checkpoints" / "best.ckpt"
    best_step = step_of(best)
    assert 20 <= best_step < step_of(last) < STEPS
    with open(last, "r+b") as f:  # a copy that stopped half-way, a disk that filled up
        f.truncate(last.stat().st_size // 2)

    resumed = run_cli("run", str(path), "--out", str(run_dir.parent), "--set", "train.sample_tokens=0")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"{last} is unreadable: it is cut short" in resumed.stderr
    assert f"resuming from {best} (step {best_step}) instead" in resumed.stderr
    got, ref = (json.loads((d / "summary.json").read_text()) for d in (run_dir, reference))
    assert got["status"] == "completed" and got["val_loss"] == pytest.approx(ref["val_loss"], abs=1e-5)
    assert logged_steps(run_dir / "metrics.jsonl") == logged_steps(reference / "metrics.jsonl")


def test_with_no_readable_checkpoint_the_run_starts_over_and_says_why(recovering):
    path, reference, run_dir = recovering
    last, best = run_dir / "checkpoints" / "last.ckpt", run_dir / "checkpoints" / "best.ckpt"
    last.write_bytes(b"")
    data = bytearray(best.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte: the member's CRC-32 no longer matches
    best.write_bytes(bytes(data))

    again = run_cli("run", str(path), "--out", str(run_dir.parent), "--set", "train.sample_tokens=0")
    assert again.returncode == 0, again.stderr[-2000:]
    assert "(starting over: " in again.stderr and "it is empty (0 bytes)" in again.stderr
    assert "fails its checksum" in again.stderr
    got, ref = (json.loads((d / "summary.json").read_text()) for d in (run_dir, reference))
    assert got["status"] == "completed" and got["val_loss"] == pytest.approx(ref["val_loss"], abs=1e-5)


def test_generate_falls_back_from_an_empty_best_checkpoint_to_last(run_copy):
    (run_copy / "checkpoints" / "best.ckpt").write_bytes(b"")
    result = run_cli("generate", str(run_copy), "--prompt", "the ", "--max-new-tokens", "4")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("the ")
    assert f"{run_copy / 'checkpoints' / 'best.ckpt'} is unreadable: it is empty (0 bytes); using last.ckpt" \
        in result.stderr

    (run_copy / "checkpoints" / "last.ckpt").write_bytes(b"PK\x03\x04 not really")
    neither = run_cli("generate", str(run_copy), "--prompt", "the ")
    assert neither.returncode == 2 and "Traceback" not in neither.stderr
    assert neither.stderr.startswith(f"lmlab: error: {run_copy}: has no readable checkpoint")


def test_an_init_from_an_empty_checkpoint_is_refused_naming_the_file(run_copy, tiny_manifest):
    checkpoint = run_copy / "checkpoints" / "last.ckpt"
    checkpoint.write_bytes(b"")
    path = tiny_manifest(f'\n[init]\nfrom = "{checkpoint}"\n')
    for verb in ("check", "run"):
        result = run_cli(verb, str(path), "--out", str(path.parent / "out")) if verb == "run" else run_cli(verb, str(path))
        assert result.returncode == 2, result.stderr
        (line,) = [line for line in result.stderr.splitlines() if line.startswith("lmlab: error:")]
        assert line == f"lmlab: error: init.from: {checkpoint}: last.ckpt is unreadable: it is empty (0 bytes)"


def test_a_checkpoint_that_does_not_read_back_never_replaces_the_previous_one(tiny_manifest, tmp_path, monkeypatch):
    (variant,) = manifest.load(tiny_manifest(steps=6, checkpoint_every=3))
    saves = []
    original = RunFolderCheckpointIO.save_checkpoint

    def flaky(self, checkpoint, path, storage_options=None):
        original(self, checkpoint, path, storage_options)
        if path.name.startswith(".last.ckpt."):
            saves.append(path)
        if len(saves) == 2 and path == saves[-1]:  # the second last.ckpt is cut short on its way to the disk
            with open(path, "r+b") as f:
                f.truncate(100)

    monkeypatch.setattr(RunFolderCheckpointIO, "save_checkpoint", flaky)
    run_dir = tmp_path / "run"
    with pytest.raises(OSError, match="does not read back .*the previous last.ckpt is kept"):
        runner.run_variant(variant, run_dir)
    assert step_of(run_dir / "checkpoints" / "last.ckpt") == 3
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "failed"
    assert not list((run_dir / "checkpoints").glob(".*.tmp"))


def test_checkpoints_are_written_inside_the_run_folder_not_in_tmpdir(tiny_manifest, tmp_path, monkeypatch):
    (variant,) = manifest.load(tiny_manifest(steps=6, checkpoint_every=3))
    # A temporary folder that does not exist: anything staged there fails (Lightning's own writer did).
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no-such-tmp"))
    written = []
    original = RunFolderCheckpointIO.save_checkpoint

    def recording(self, checkpoint, path, storage_options=None):
        written.append(path)
        original(self, checkpoint, path, storage_options)

    monkeypatch.setattr(RunFolderCheckpointIO, "save_checkpoint", recording)
    result = runner.run_variant(variant, tmp_path / "run")
    assert result.summary["status"] == "completed"
    assert written and all(str(p).startswith(str(tmp_path / "run" / "checkpoints")) for p in written)
    assert all(f".{os.getpid()}." in str(p) for p in written)  # a per-process temporary name
