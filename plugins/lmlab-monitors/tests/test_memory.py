"""memory: a 200 MB allocation shows in its window's peak and not in the next; the device path with
CUDA's counters stood in for; the warning; a tiny run end to end."""

import json
import mmap
from types import SimpleNamespace

import pytest
import torch

from lmlab_monitors import memory
from lmlab_monitors.memory import Memory, MemoryOptions
from lmlab.testing import stand_in_run

MIB = 2 ** 20


class FakeControl:
    def __init__(self):
        self.run = stand_in_run()
        self.notes: list[str] = []

    def note(self, text: str) -> None:
        self.notes.append(text)


def log_step(m: Memory, control, device: str = "cpu") -> dict:
    loss = torch.tensor(1.0) if device == "cpu" else SimpleNamespace(device=torch.device(device))
    return m.lmlab_train_batch_end(loss=loss, log=True, control=control)


def allocate_and_free(mb: int) -> None:
    # Fresh pages from the kernel, every one touched (resident, not just reserved): a malloc'd tensor
    # may reuse memory the process already holds (the heap left by earlier tests in the same process),
    # which raises no peak.
    block = mmap.mmap(-1, mb * MIB)
    for at in range(0, mb * MIB, mmap.PAGESIZE):
        block[at] = 1
    assert block[mb * MIB - mmap.PAGESIZE] == 1
    block.close()


def test_window_peak_sees_an_allocation_and_resets_after_it():
    control = FakeControl()
    m = Memory()
    assert m.lmlab_train_batch_end(loss=torch.tensor(1.0), log=False, control=control) is None
    log_step(m, control)  # closes whatever came before
    baseline = log_step(m, control)["host_rss_mb"]
    allocate_and_free(200)
    grown = log_step(m, control)["host_rss_mb"]
    assert grown >= baseline + 180  # the peak, though the tensor is gone by the logging step
    after = log_step(m, control)["host_rss_mb"]
    if memory.reset_peak_rss():
        assert after <= grown - 150  # the next window does not inherit the peak
    summary = m.lmlab_run_end()
    assert summary["host_rss_peak_mb"] >= grown and "device_mem_peak_mb" not in summary


def test_fallback_without_proc(monkeypatch):
    import builtins

    real_open = builtins.open

    def no_proc(path, *args, **kwargs):
        if str(path).startswith("/proc/self/"):
            raise OSError("no /proc here")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", no_proc)
    import psutil

    rss, is_peak = memory.read_peak_rss()
    assert not is_peak and rss == pytest.approx(psutil.Process().memory_info().rss / MIB, rel=0.05)
    assert memory.reset_peak_rss() is False


def test_device_memory_on_cuda(monkeypatch):
    """CUDA's counters stood in for: what is read, reset and warned about."""
    peaks = {"allocated": 3000 * MIB, "reserved": 3700 * MIB}
    resets = []
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: peaks["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: peaks["reserved"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: resets.append(device))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: SimpleNamespace(total_memory=4000 * MIB))
    control = FakeControl()
    m = Memory(MemoryOptions(warn_fraction=0.95))
    metrics = log_step(m, control, "cuda:0")
    assert metrics["device_mem_mb"] == 3000 and metrics["host_rss_mb"] > 0
    assert resets == [torch.device("cuda", 0)]
    assert control.notes == []  # 3700 of 4000 reserved: 92.5 % < 95 %
    peaks.update(allocated=3500 * MIB, reserved=3900 * MIB)
    metrics = log_step(m, control, "cuda:0")
    assert metrics["device_mem_mb"] == 3500
    assert len(control.notes) == 1 and "98% of the GPU cuda:0's 4,000 MiB" in control.notes[0]
    peaks.update(allocated=1000 * MIB, reserved=3950 * MIB)
    log_step(m, control, "cuda:0")
    assert len(control.notes) == 1  # once per run
    summary = m.lmlab_run_end()
    assert summary["device_mem_peak_mb"] == 3500 and summary["host_rss_peak_mb"] > 0


def test_host_warning_once_on_cpu(monkeypatch):
    import psutil

    rss = memory.read_peak_rss()[0]
    total = psutil.virtual_memory().total / MIB
    control = FakeControl()
    m = Memory(MemoryOptions(warn_fraction=min(1.0, rss / total / 2)))
    log_step(m, control)
    log_step(m, control)
    assert len(control.notes) == 1 and "of the host's" in control.notes[0]
    control = FakeControl()
    m = Memory()  # 0.9 of the host's memory: not this test
    log_step(m, control)
    assert control.notes == []


def test_end_to_end_keys(tiny_manifest, tmp_path):
    from lmlab.testing.runs import main

    path = tiny_manifest('[monitor]\nuse = ["memory"]\n')
    assert main(["run", str(path), "--out", str(tmp_path / "runs")]) == 0
    run = tmp_path / "runs" / "default"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "train_loss" in r]
    assert all(r["host_rss_mb"] > 50 and "device_mem_mb" not in r for r in train)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["host_rss_peak_mb"] >= max(r["host_rss_mb"] for r in train)
    assert "device_mem_peak_mb" not in summary
