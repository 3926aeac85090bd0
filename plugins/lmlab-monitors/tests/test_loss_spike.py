"""loss-spike: a synthetic loss sequence through the hooks, against z-scores and standard deviations
computed with the statistics module (sample standard deviation, statistics.stdev, throughout)."""

import json
import math
import random
import statistics

import pytest
import torch

from lmlab_monitors.loss_spike import LossSpike, LossSpikeOptions, detrended_std
from lmlab.testing import stand_in_run


class FakeControl:
    def __init__(self, log_every: int):
        self.run = stand_in_run(train={"log_every": log_every})
        self.notes: list[str] = []

    def note(self, text: str) -> None:
        self.notes.append(text)


def feed(losses: list[float], log_every: int = 10, **options):
    """Steps 1..len(losses) through the hook; returns the monitor, the control and {step: metrics}."""
    control = FakeControl(log_every)
    m = LossSpike(LossSpikeOptions(**options))
    m.lmlab_run_start(control=control)
    logged = {}
    for step, loss in enumerate(losses, 1):
        log = step % log_every == 0 or step == len(losses)
        out = m.lmlab_train_batch_end(step=step, loss=torch.tensor(loss), log=log, control=control)
        if log:
            logged[step] = out
        else:
            assert out is None
    return m, control, logged


def noisy(n: int, seed: int = 0, mean: float = 3.0, sd: float = 0.02) -> list[float]:
    rng = random.Random(seed)
    return [rng.gauss(mean, sd) for _ in range(n)]


def reference_z(losses: list[float], index: int, window: int) -> float:
    """z of losses[index] against the `window` finite losses before it."""
    before = [x for x in losses[:index] if math.isfinite(x)][-window:]
    return (losses[index] - statistics.mean(before)) / statistics.stdev(before)


def test_spike_flagged_at_its_step_with_the_reference_z():
    losses = noisy(60)
    losses[44] = 3.5  # step 45
    m, control, logged = feed(losses, window=30, z=4.0, min_history=20)
    # float32 on the way through the device buffer: compare with the values as stored
    stored = [float(torch.tensor(x)) for x in losses]
    assert [s["step"] for s in m.spikes] == [45]
    z = reference_z(stored, 44, 30)
    assert m.spikes[0]["z"] == pytest.approx(z, rel=1e-9)
    assert m.spikes[0]["loss"] == pytest.approx(stored[44])
    assert len(control.notes) == 1
    assert control.notes[0].startswith("step 45: loss spike") and f"z = {z:.1f}" in control.notes[0]
    # No step before or after it comes near the threshold.
    for i in range(20, 60):
        if i != 44:
            assert reference_z(stored, i, 30) < 4.0
    assert logged[40]["loss_spikes"] == 0 and logged[50]["loss_spikes"] == 1 and logged[60]["loss_spikes"] == 1
    # loss_std: sample standard deviation of the last 30 losses
    assert logged[60]["loss_std"] == pytest.approx(statistics.stdev(stored[-30:]), rel=1e-9)
    assert logged[40]["loss_std"] == pytest.approx(statistics.stdev(stored[10:40]), rel=1e-9)
    assert m.lmlab_run_end(control=control) == {"loss_std_last": logged[60]["loss_std"], "loss_spikes": 1}


def test_no_spike_before_min_history_and_drops_never_count():
    losses = noisy(40)
    losses[9] = 5.0  # step 10: only 9 losses before it
    losses[34] = 1.0  # a sudden drop: z far below -4
    m, control, _ = feed(losses, window=100, min_history=20)
    assert m.spikes == [] and control.notes == []


def test_non_finite_losses_are_ignored():
    losses = noisy(60, seed=1)
    losses[47] = math.nan
    losses[52] = math.inf
    m, control, logged = feed(losses, window=30)
    stored = [float(torch.tensor(x)) for x in losses]
    finite = [x for x in stored if math.isfinite(x)]
    assert len(m.history) == 30 and all(math.isfinite(x) for x in m.history)
    assert logged[60]["loss_std"] == pytest.approx(statistics.stdev(finite[-30:]), rel=1e-9)
    assert m.spikes == []


def test_losses_between_log_steps_are_all_judged():
    # log_every 25 with the spike in the middle of a window, and a buffer that fills exactly
    losses = noisy(75, seed=2)
    losses[61] = 3.4  # step 62
    m, control, logged = feed(losses, log_every=25, window=50)
    stored = [float(torch.tensor(x)) for x in losses]
    assert [s["step"] for s in m.spikes] == [62]
    assert m.spikes[0]["z"] == pytest.approx(reference_z(stored, 61, 50), rel=1e-9)
    assert set(logged) == {25, 50, 75}


def test_falling_loss_is_not_instability_but_noise_is():
    # A loss falling from 4 to 2 over the window has a large std but no noise around its trend.
    falling = [4.0 - 2.0 * i / 99 + g for i, g in enumerate(noisy(100, seed=3, mean=0.0, sd=0.01))]
    m, control, logged = feed(falling, window=100)
    assert logged[100]["loss_std"] > 0.5
    assert not any("unstable" in n for n in control.notes)

    shaky = noisy(100, seed=4, mean=3.0, sd=0.8)
    m, control, logged = feed(shaky, window=100, z=10.0)
    stored = [float(torch.tensor(x)) for x in shaky]
    unstable = [n for n in control.notes if "training is unstable" in n]
    assert len(unstable) == 1  # once, at the first log step with a full window
    assert unstable[0].startswith("step 100:")
    assert f"{detrended_std(stored):.3g}" in unstable[0] and "lower the learning rate or raise warmup" in unstable[0]


def test_detrended_std_matches_a_least_squares_fit():
    values = noisy(30, seed=5, mean=2.0, sd=0.3)
    values = [v + 0.05 * i for i, v in enumerate(values)]
    fit = statistics.linear_regression(range(30), values)
    residuals = [v - (fit.intercept + fit.slope * i) for i, v in enumerate(values)]
    assert detrended_std(values) == pytest.approx(math.sqrt(sum(r * r for r in residuals) / 28), rel=1e-9)


def test_no_host_sync_on_steps_that_are_not_logged(no_host_sync):
    control = FakeControl(log_every=5)
    m = LossSpike(LossSpikeOptions(min_history=2))
    m.lmlab_run_start(control=control)
    for step, loss in enumerate(noisy(30), 1):
        no_host_sync[0] = step % 5 != 0
        m.lmlab_train_batch_end(step=step, loss=torch.tensor(loss), log=step % 5 == 0, control=control)
    no_host_sync[0] = False
    assert len(m.history) == 30


def test_end_to_end_keys(tiny_manifest, tmp_path):
    from lmlab.testing.runs import main

    path = tiny_manifest('[monitor]\nuse = ["loss-spike"]\n\n[monitor.loss-spike]\nwindow = 4\nmin_history = 2\n')
    assert main(["run", str(path), "--out", str(tmp_path / "runs")]) == 0
    run = tmp_path / "runs" / "default"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "train_loss" in r]
    assert all("loss_spikes" in r and "loss_std" in r for r in train)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["loss_std_last"] == pytest.approx(train[-1]["loss_std"])
    assert summary["loss_spikes"] == train[-1]["loss_spikes"]


def test_a_min_history_the_window_can_never_hold_is_refused_before_anything_is_written(tiny_manifest, tmp_path):
    import os
    import subprocess
    import sys

    path = tiny_manifest('[monitor]\nuse = ["loss-spike"]\n\n[monitor.loss-spike]\nwindow = 10\nmin_history = 11\n')
    for args in (["check", str(path)], ["run", str(path), "--out", str(tmp_path / "runs")]):
        result = subprocess.run([sys.executable, "-m", "lmlab", *args], capture_output=True, text=True, timeout=300,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        (line,) = result.stderr.splitlines()
        assert line.startswith("lmlab: error: monitor.loss-spike.min_history: must be at most window (10)"), line
    assert not (tmp_path / "runs").exists()
    LossSpikeOptions(window=10, min_history=10)  # the whole window is a history that can be reached
