"""throughput: MFU against a hand computation, the GPU table, the CPU peak's cache, the data-wait
share from synthetic step timings, and a tiny run end to end."""

import json
import statistics

import pytest
import torch
from torch import nn

from lmlab.api import LaunchOptions, StepTiming
from lmlab.testing import stand_in_run
from lmlab_monitors import throughput
from lmlab_monitors.throughput import (Throughput, ThroughputOptions, flops_per_token, gpu_peak, matmul_params)


class FakeControl:
    def __init__(self, run):
        self.run = run
        self.notes: list[str] = []

    def note(self, text: str) -> None:
        self.notes.append(text)


class Tiny(nn.Module):
    """The core's layout: tok_emb, position (learned), blocks, norm_f, head (tied or not)."""

    def __init__(self, tied: bool):
        super().__init__()
        self.tok_emb = nn.Embedding(50, 8)  # 400
        self.position = nn.Module()
        self.position.weight = nn.Parameter(torch.zeros(16, 8))  # 128
        self.blocks = nn.ModuleList([nn.Linear(8, 32), nn.Linear(32, 8)])  # 288 + 264
        self.norm_f = nn.LayerNorm(8)  # 16
        self.head = nn.Linear(8, 50, bias=False)  # 400
        if tied:
            self.head.weight = self.tok_emb.weight


MODEL = {"n_layers": 2, "d_model": 8, "n_heads": 2, "block_size": 16}
RUN = stand_in_run(model=MODEL, train={"precision": "32-true"}, parallel="single")


def test_matmul_params_count_the_head_but_not_the_lookups():
    assert matmul_params(Tiny(tied=False)) == 288 + 264 + 16 + 400
    assert matmul_params(Tiny(tied=True)) == 288 + 264 + 16 + 400  # the tied matrix counted once, as the head


def test_mfu_against_a_hand_computation():
    control = FakeControl(RUN)
    m = Throughput(ThroughputOptions(peak_tflops=2.0))
    m.lmlab_run_start(control=control)
    model, loss = Tiny(tied=True), torch.tensor(1.0)
    timings = [StepTiming(step_s=0.5, data_wait_s=0.1, tokens=1000), StepTiming(step_s=1.5, data_wait_s=0.3, tokens=1000)]
    assert m.lmlab_train_batch_end(step=1, loss=loss, model=model, log=False, timing=timings[0], control=control) is None
    metrics = m.lmlab_train_batch_end(step=2, loss=loss, model=model, log=True, timing=timings[1], control=control)
    n = 288 + 264 + 16 + 400
    per_token = 6 * n + 12 * 2 * 8 * 16
    assert flops_per_token(n, 2, 8, 16) == per_token
    achieved = per_token * 2000 / 2.0  # FLOP/s over the window
    assert metrics["achieved_tflops"] == pytest.approx(achieved / 1e12)
    assert metrics["mfu"] == pytest.approx(achieved / 2.0e12)
    assert metrics["data_wait"] == pytest.approx((0.1 / 0.5 + 0.3 / 1.5) / 2)
    summary = m.lmlab_run_end()
    assert summary["peak_tflops"] == 2.0 and summary["peak_source"] == "option"
    assert summary["mfu_median"] == pytest.approx(metrics["mfu"])


def run_windows(m, control, windows: list[list[tuple[float, float]]], step: int = 0):
    """Feeds windows of (step_s, data_wait_s) steps after ``step``, logging at each window's end;
    returns the metrics of each."""
    model, loss, out = Tiny(tied=True), torch.tensor(1.0), []
    for window in windows:
        for i, (step_s, wait) in enumerate(window):
            step += 1
            log = i == len(window) - 1
            result = m.lmlab_train_batch_end(step=step, loss=loss, model=model, log=log,
                                             timing=StepTiming(step_s, wait, 64), control=control)
            if log:
                out.append(result)
    return out


def test_data_wait_share_per_window_and_its_warning():
    control = FakeControl(RUN)
    m = Throughput(ThroughputOptions(peak_tflops=1.0, data_wait_warn=0.4))
    first = [(1.0, 0.9)] * 5  # start-up: never judged
    fine = [(1.0, 0.1)] * 9 + [(5.0, 4.9)]  # one step after an evaluation: the median ignores it
    slow = [(1.0, 0.5), (2.0, 1.2), (1.0, 0.7), (1.0, 0.6), (1.0, 0.5)] * 2
    fine_share, slow_shares = [0.1] * 9 + [0.98], [0.5, 0.6, 0.7, 0.6, 0.5] * 2
    metrics = run_windows(m, control, [first, fine, fine])
    assert [r["data_wait"] for r in metrics] == pytest.approx([0.9, statistics.fmean(fine_share),
                                                               statistics.fmean(fine_share)])
    assert control.notes == []
    metrics += run_windows(m, control, [slow], step=25)
    assert metrics[-1]["data_wait"] == pytest.approx(statistics.fmean(slow_shares))
    # The median step of the last 30 steps (20 fine, 10 slow) still waits 10 %: no warning yet.
    assert statistics.median(fine_share * 2 + slow_shares) == pytest.approx(0.1)
    assert control.notes == []
    metrics += run_windows(m, control, [slow, slow], step=35)
    assert len(control.notes) == 1  # once per run
    recent = (fine_share * 2 + slow_shares * 2)[-50:]  # the 40 steps at the second slow window
    assert control.notes[0].startswith("step 45: the step waits for its batch "
                                       f"{statistics.median(recent):.0%} of the time: an I/O or CPU bottleneck")
    summary = m.lmlab_run_end()
    assert summary["data_wait_median"] == pytest.approx(statistics.median(r["data_wait"] for r in metrics[1:]))


def test_low_mfu_warning_is_off_by_default_and_fires_when_set():
    control = FakeControl(RUN)
    m = Throughput(ThroughputOptions(peak_tflops=1000.0))
    run_windows(m, control, [[(1.0, 0.0)]] * 6)
    assert control.notes == []
    m = Throughput(ThroughputOptions(peak_tflops=1000.0, low_mfu=0.3))
    run_windows(m, control, [[(1.0, 0.0)]] * 6)
    assert len(control.notes) == 1 and "MFU is" in control.notes[0]


@pytest.mark.parametrize("name,precision,tf32,peak", [
    ("NVIDIA H100 80GB HBM3", "bf16-mixed", True, 989.4),
    ("NVIDIA H100 80GB HBM3", "32-true", True, 494.7),
    ("NVIDIA H100 PCIe", "bf16-true", True, 756.5),
    ("NVIDIA H200", "bf16-mixed", True, 989.4),
    ("NVIDIA A100-SXM4-80GB", "bf16-mixed", True, 312.0),
    ("NVIDIA A100-SXM4-80GB", "32-true", True, 156.0),
    ("NVIDIA A100 80GB PCIe", "32-true", False, 19.5),  # float32 matmuls without TF32
    ("NVIDIA A100-SXM4-40GB", "64-true", True, 19.5),
    ("NVIDIA A10G", "bf16-mixed", True, 125.0),
    ("NVIDIA L4", "bf16-mixed", True, 121.0),
    ("NVIDIA L40S", "bf16-mixed", True, 362.0),
    ("Tesla V100-SXM2-16GB", "16-mixed", True, 125.0),
    ("Tesla V100-SXM2-16GB", "32-true", True, 15.7),
    ("NVIDIA GeForce RTX 4090", "bf16-mixed", True, 165.2),
    ("Some Future GPU", "bf16-mixed", True, None),
])
def test_gpu_table_lookup(name, precision, tf32, peak):
    assert gpu_peak(name, precision, tf32) == peak


def test_gpu_peak_is_looked_up_by_the_device_name(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-40GB")
    control = FakeControl(stand_in_run(model=MODEL, train={"precision": "bf16-mixed"}, parallel="single"))
    m = Throughput(ThroughputOptions())
    m._resolve(Tiny(tied=True), torch.device("cuda", 0), control)
    assert (m.peak, m.peak_source) == (312.0, "table")

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Mystery Accelerator 9000")
    m = Throughput(ThroughputOptions())
    m._resolve(Tiny(tied=True), torch.device("cuda", 0), control)
    assert m.peak is None and "peak_tflops" in control.notes[-1]


def test_cpu_peak_is_measured_once_and_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("LMLAB_CACHE", str(tmp_path / "cache"))
    calls = []
    monkeypatch.setattr(throughput, "measure_cpu_peak", lambda: calls.append(1) or 0.125)
    threads = torch.get_num_threads()
    assert throughput.cpu_peak() == 0.125
    assert throughput.cpu_peak() == 0.125
    assert len(calls) == 1
    cached = json.loads((tmp_path / "cache" / "throughput" / "cpu-peak.json").read_text())
    key = f"{throughput.cpu_model()} | {threads} threads"
    assert cached[key]["tflops"] == 0.125

    # Through the hooks: measured (from the cache here) in lmlab_run_start, on a CPU run.
    control = FakeControl(stand_in_run(model=MODEL, parallel=("single", LaunchOptions(accelerator="cpu"))))
    m = Throughput(ThroughputOptions())
    m.lmlab_run_start(control=control)
    metrics = run_windows(m, control, [[(1.0, 0.0)]])
    assert len(calls) == 1
    assert metrics[0]["mfu"] == pytest.approx(metrics[0]["achieved_tflops"] / 0.125)
    assert m.lmlab_run_end()["peak_source"] == "measured"

    # Another thread count is another measurement.
    try:
        torch.set_num_threads(threads + 1)
        throughput.cpu_peak()
        assert len(calls) == 2
    finally:
        torch.set_num_threads(threads)


def test_the_benchmark_measures_something():
    tflops = throughput.matmul_tflops(seconds=0.05, n=128)
    assert 1e-5 < tflops < 100


def test_end_to_end_metrics_and_summary(tiny_manifest, tmp_path, monkeypatch):
    monkeypatch.setenv("LMLAB_CACHE", str(tmp_path / "cache"))  # no peak cached by an earlier test
    monkeypatch.setattr(throughput, "measure_cpu_peak", lambda: 0.05)  # the real one takes a second
    from lmlab.testing.runs import main

    path = tiny_manifest('[monitor]\nuse = ["throughput"]\n')
    assert main(["run", str(path), "--out", str(tmp_path / "runs")]) == 0
    run = tmp_path / "runs" / "default"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "train_loss" in r]
    assert all(0 < r["mfu"] < 1 and 0 <= r["data_wait"] <= 1 and r["achieved_tflops"] > 0 for r in train)
    for r in train:
        assert r["mfu"] == pytest.approx(r["achieved_tflops"] / 0.05)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["peak_source"] == "measured" and summary["peak_tflops"] == 0.05
    assert summary["mfu_median"] == pytest.approx(statistics.median(r["mfu"] for r in train[1:]))
    assert summary["data_wait_median"] == pytest.approx(statistics.median(r["data_wait"] for r in train[1:]))


def test_a_peak_measured_under_load_is_measured_again_when_the_machine_is_quieter(monkeypatch, tmp_path):
    monkeypatch.setenv("LMLAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(throughput, "_load", lambda: 2.0)  # another job shares the cores
    monkeypatch.setattr(throughput, "measure_cpu_peak", lambda: 0.06)
    assert throughput.cpu_peak() == 0.06
    monkeypatch.setattr(throughput, "measure_cpu_peak", lambda: 0.2)
    assert throughput.cpu_peak() == 0.06  # as busy as then: the cached figure stands
    monkeypatch.setattr(throughput, "_load", lambda: 0.1)
    assert throughput.cpu_peak() == 0.2  # quieter: measured again, and the better figure kept
    monkeypatch.setattr(throughput, "measure_cpu_peak", lambda: 0.1)
    assert throughput.cpu_peak() == 0.2  # a quiet measurement is not taken again
