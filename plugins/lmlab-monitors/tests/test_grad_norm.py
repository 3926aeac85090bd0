"""grad-norm: the logged norms against norms computed here, the band warning's timing and text, the
summary, a tiny run end to end, and the refusal of a band upside down."""

import json
import math
import statistics

import pytest
import torch
from torch import nn

from lmlab_monitors.grad_norm import HIGH_MEANING, LOW_MEANING, GradNorm, GradNormOptions, group_of
from lmlab.testing import stand_in_run


class FakeControl:
    def __init__(self, log_every: int = 1, max_steps: int = 1000):
        self.run = stand_in_run(train={"log_every": log_every, "max_steps": max_steps})
        self.notes: list[str] = []

    def note(self, text: str) -> None:
        self.notes.append(text)


class Tiny(nn.Module):
    """Named like the core's model: tok_emb, blocks.N..., norm_f, head."""

    def __init__(self):
        super().__init__()
        self.tok_emb = nn.Embedding(7, 4)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)) for _ in range(3)])
        self.norm_f = nn.LayerNorm(4)
        self.head = nn.Linear(4, 7, bias=False)


def monitor(control: FakeControl, **options) -> GradNorm:
    m = GradNorm(GradNormOptions(**options))
    m.lmlab_run_start(control=control)
    return m


def step_once(m: GradNorm, control: FakeControl, step: int, model: nn.Module, norm: torch.Tensor, log: bool):
    """One optimizer step as the core calls the hooks: before the step (step = steps done so far),
    then after it (step + 1)."""
    m.lmlab_before_optimizer_step(step=step, model=model, grad_norm=norm)
    return m.lmlab_train_batch_end(step=step + 1, log=log, control=control)


def test_global_and_per_block_norms_match_hand_computed_ones():
    torch.manual_seed(0)
    model = Tiny()
    scales = {"tok_emb": 0.1, "blocks.0": 3.0, "blocks.1": 0.2, "blocks.2": 1.5, "norm_f": 0.05, "head": 2.0}
    for name, p in model.named_parameters():
        p.grad = torch.randn_like(p) * scales[group_of(name)]
    grads = [p.grad for p in model.parameters()]
    # The core's norm: what lmlab_before_optimizer_step receives.
    core_norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0).float()
    expected_global = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])).item()

    groups = {"tok_emb": [model.tok_emb.weight], "norm_f": list(model.norm_f.parameters()),
              "head": [model.head.weight], **{f"blocks.{i}": list(b.parameters()) for i, b in enumerate(model.blocks)}}
    expected = {name: math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in params))
                for name, params in groups.items()}
    top3 = sorted(expected, key=expected.get, reverse=True)[:3]

    control = FakeControl(log_every=5)
    m = monitor(control, top_k=3)
    assert step_once(m, control, 3, model, core_norm, log=False) is None  # step 4: not a log step
    metrics = step_once(m, control, 4, model, core_norm, log=True)  # step 5: logged
    assert metrics["grad_norm"] == pytest.approx(expected_global, rel=1e-5)
    per_block = {k.removeprefix("grad_norm/"): v for k, v in metrics.items() if k.startswith("grad_norm/")}
    assert set(per_block) == set(top3)
    for name, value in per_block.items():
        assert value == pytest.approx(expected[name], rel=1e-5)


def test_no_host_sync_on_steps_that_are_not_logged(no_host_sync):
    model = Tiny()
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    control = FakeControl(log_every=4)
    m = monitor(control, patience=2)
    for step in range(12):
        logged = (step + 1) % 4 == 0
        no_host_sync[0] = not logged
        out = step_once(m, control, step, model, torch.tensor(0.001), log=logged)
        assert (out is not None) == logged
    no_host_sync[0] = False
    assert len(control.notes) == 1


def test_per_layer_off_logs_only_the_global_norm():
    model = Tiny()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    control = FakeControl()
    m = monitor(control, per_layer=False)
    metrics = step_once(m, control, 0, model, torch.tensor(2.0), log=True)
    assert metrics == {"grad_norm": 2.0}


def test_no_norm_under_deepspeed_logs_nothing():
    control = FakeControl()
    m = monitor(control)
    assert step_once(m, control, 0, Tiny(), None, log=True) is None
    assert m.lmlab_run_end() == {}


def test_final_step_is_a_log_step_too():
    model = Tiny()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    control = FakeControl(log_every=10, max_steps=7)
    m = monitor(control)
    assert m.logs_at(7) and m.logs_at(10) and not m.logs_at(6)
    metrics = step_once(m, control, 6, model, torch.tensor(1.5), log=True)
    assert metrics["grad_norm"] == 1.5 and any(k.startswith("grad_norm/") for k in metrics)


@pytest.mark.parametrize("value,meaning", [(0.001, LOW_MEANING), (500.0, HIGH_MEANING)])
def test_band_warning_after_patience_steps_once_per_episode(value, meaning):
    model = Tiny()
    control = FakeControl(log_every=1)
    m = monitor(control, patience=5, per_layer=False)
    step = 0
    for _ in range(4):  # four steps outside: not yet
        step_once(m, control, step, model, torch.tensor(value), log=True)
        step += 1
    assert control.notes == []
    step_once(m, control, step, model, torch.tensor(value), log=True)  # the fifth
    step += 1
    assert len(control.notes) == 1
    assert meaning in control.notes[0] and "5 steps in a row" in control.notes[0]
    assert control.notes[0].startswith(f"step {step}:")
    for _ in range(10):  # the same episode goes on: no second warning
        step_once(m, control, step, model, torch.tensor(value), log=True)
        step += 1
    assert len(control.notes) == 1
    step_once(m, control, step, model, torch.tensor(1.0), log=True)  # back in the band: episode over
    step += 1
    for _ in range(5):  # a new episode warns again
        step_once(m, control, step, model, torch.tensor(value), log=True)
        step += 1
    assert len(control.notes) == 2 and meaning in control.notes[1]


def test_an_episode_between_two_log_steps_is_still_reported():
    # Steps 1-6 low, then back in the band; the first log step after the episode is 10.
    model = Tiny()
    control = FakeControl(log_every=10)
    m = monitor(control, patience=6, per_layer=False)
    for step in range(10):
        norm = torch.tensor(0.001 if step < 6 else 1.0)
        step_once(m, control, step, model, norm, log=(step + 1) % 10 == 0)
    assert len(control.notes) == 1 and LOW_MEANING in control.notes[0] and "step 10:" in control.notes[0]

    control = FakeControl(log_every=10)  # five low steps only, with patience 6: no warning
    m = monitor(control, patience=6, per_layer=False)
    for step in range(10):
        step_once(m, control, step, model, torch.tensor(0.001 if step < 5 else 1.0), log=(step + 1) % 10 == 0)
    assert control.notes == []


def test_summary_median_max_and_outside_fraction():
    model = Tiny()
    control = FakeControl(log_every=2)
    m = monitor(control, low=0.5, high=3.0, per_layer=False)
    values = [1.0, 0.2, 2.0, 7.0, 1.5, 0.9, 4.0, 0.3, 1.1, 2.5]
    logged = []
    for step, v in enumerate(values):
        out = step_once(m, control, step, model, torch.tensor(v), log=(step + 1) % 2 == 0)
        if out:
            logged.append(out["grad_norm"])
    assert logged == pytest.approx(values[1::2])
    summary = m.lmlab_run_end()
    assert summary["grad_norm_median"] == pytest.approx(statistics.median(values[1::2]))
    assert summary["grad_norm_max"] == pytest.approx(max(values[1::2]))
    outside = [v for v in values[1::2] if v < 0.5 or v > 3.0]
    assert summary["grad_norm_outside_band"] == pytest.approx(len(outside) / len(values[1::2]))


def test_end_to_end_metrics_and_summary(tiny_manifest, tmp_path):
    from lmlab.testing.runs import main

    path = tiny_manifest('[monitor]\nuse = ["grad-norm"]\n\n[monitor.grad-norm]\ntop_k = 2\n')
    assert main(["run", str(path), "--out", str(tmp_path / "runs")]) == 0
    run = tmp_path / "runs" / "default"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "train_loss" in r]
    assert [r["step"] for r in train] == [2, 4, 6]
    for row in train:
        assert row["grad_norm"] > 0 and math.isfinite(row["grad_norm"])
        blocks = {k: v for k, v in row.items() if k.startswith("grad_norm/")}
        assert len(blocks) == 2 and all(v <= row["grad_norm"] * (1 + 1e-6) for v in blocks.values())
    summary = json.loads((run / "summary.json").read_text())
    assert summary["grad_norm_median"] == pytest.approx(statistics.median(r["grad_norm"] for r in train))
    assert summary["grad_norm_max"] == pytest.approx(max(r["grad_norm"] for r in train))
    assert summary["grad_norm_outside_band"] == 0.0


def test_band_upside_down_is_refused_by_check(tiny_manifest, capsys):
    from lmlab.testing.runs import main

    path = tiny_manifest('[monitor]\nuse = ["grad-norm"]\n\n[monitor.grad-norm]\nlow = 1.0\nhigh = 0.5\n')
    assert main(["check", str(path)]) == 2
    assert "monitor.grad-norm.high" in capsys.readouterr().err


def test_options_bounds():
    with pytest.raises(Exception, match="monitor.grad-norm.high"):
        GradNormOptions(low=2.0, high=2.0)
    with pytest.raises(Exception):
        GradNormOptions(low=0.0)
    with pytest.raises(Exception):
        GradNormOptions(patience=0)
