"""Physically meaningful hyper-parameters: lr_scaling with base_batch_tokens, grad_clip = "auto", the
[resolved] numbers a run records, and the wsd / inverse-sqrt schedules."""

import json
import math

import pytest

from lmlab import manifest
from lmlab.cli.main import main
from lmlab.train.runner import run_variant
from lmlab.train.schedule import lr_factor
from lmlab.rundir import read_metrics


def _load(path, *overrides):
    (variant,) = manifest.load(path, list(overrides))
    return variant


def test_sqrt_rule_gives_the_learning_rate_at_two_batch_sizes(tiny_manifest):
    # The tiny manifest: batch_size 4 × block_size 16 = 64 tokens per step; lr chosen for 64.
    path = tiny_manifest('\n[optimizer]\nuse = "adamw"\nlr = 1e-3\n')
    rule = ["train.lr_scaling=sqrt", "train.base_batch_tokens=64"]
    small, large = _load(path, *rule), _load(path, *rule, "train.batch_size=16")
    assert small.resolved.batch_tokens == 64 and large.resolved.batch_tokens == 256
    assert small.resolved.lr == pytest.approx(1e-3) and large.resolved.lr == pytest.approx(2e-3)  # sqrt(256/64)
    linear = _load(path, "train.lr_scaling=linear", "train.base_batch_tokens=64", "train.batch_size=16")
    assert linear.resolved.lr_factor == pytest.approx(4.0)
    accumulated = _load(path, *rule, "train.grad_accum=4")  # the global batch counts accumulation
    assert accumulated.resolved.lr == pytest.approx(2e-3)
    # min_lr's default (a tenth of the peak) follows the scaled peak
    assert large.train.min_lr == pytest.approx(2e-4)


def test_the_scaled_learning_rate_is_what_trains(tiny_manifest, tmp_path):
    path = tiny_manifest('\n[optimizer]\nuse = "adamw"\nlr = 1e-3\n', steps=4)
    rule = ["train.lr_scaling=sqrt", "train.base_batch_tokens=64", "train.lr_schedule=constant",
            "train.warmup_steps=0"]
    lrs = {}
    for batch in (4, 16):
        variant = _load(path, *rule, f"train.batch_size={batch}")
        run_variant(variant, tmp_path / str(batch))
        lrs[batch] = [r["lr"] for r in read_metrics(tmp_path / str(batch) / "metrics.jsonl") if "lr" in r]
        recorded = (tmp_path / str(batch) / "manifest.toml").read_text()
        assert "[resolved]" in recorded and f"batch_tokens = {batch * 16}" in recorded
    assert lrs[4] == pytest.approx([1e-3] * len(lrs[4]))
    assert lrs[16] == pytest.approx([2e-3] * len(lrs[16]))


def test_grad_clip_auto_is_a_tenth_of_the_square_root_of_the_depth(tiny_manifest, tmp_path, capsys):
    path = tiny_manifest(steps=2)
    variant = _load(path, "train.grad_clip=auto", "model.n_layers=2")
    assert variant.grad_clip == pytest.approx(0.1 * math.sqrt(2))
    assert _load(path, "train.grad_clip=auto", "model.n_layers=16").grad_clip == pytest.approx(0.4)
    result = run_variant(variant, tmp_path / "run")
    assert result.module.trainer.gradient_clip_val == pytest.approx(0.1 * math.sqrt(2))
    assert main(["check", str(path), "--set", "train.grad_clip=auto"]) == 0
    assert f"grad_clip = {0.1 * math.sqrt(2)!r}" in capsys.readouterr().out


def test_a_rerun_of_the_recorded_manifest_resolves_the_same_numbers(tiny_manifest, tmp_path):
    path = tiny_manifest(steps=2)
    variant = _load(path, "train.grad_clip=auto", "train.lr_scaling=sqrt", "train.base_batch_tokens=32")
    run_variant(variant, tmp_path / "run")
    again = _load(tmp_path / "run" / "manifest.toml")
    assert again.resolved == variant.resolved


@pytest.mark.parametrize("override, key", [
    (["train.grad_clip=auto", "resolved.grad_clip=0.5"], "resolved.grad_clip"),
    (["train.lr_scaling=sqrt", "train.base_batch_tokens=64", "resolved.lr=0.5"], "resolved.lr"),
    (["train.lr_scaling=sqrt"], "train.base_batch_tokens"),
    (["optimizer.momentum=0.9"], "optimizer.momentum"),
    (["train.grad_clip=-1"], "train.grad_clip"),
])
def test_contradictions_are_one_line_naming_the_key(tiny_manifest, capsys, override, key):
    path = tiny_manifest()
    args = ["check", str(path)]
    for item in override:
        args += ["--set", item]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"lmlab: error: {key}:"), err
    if key == "optimizer.momentum":
        assert "'sgd'" in err[0]  # the optimizer it belongs to
    if key == "resolved.grad_clip":
        assert "0.1·sqrt(model.n_layers = 2)" in err[0]


def test_wsd_holds_the_peak_then_decays_linearly_over_the_last_fraction():
    kw = dict(warmup=10, decay_steps=100, min_ratio=0.1, kind="wsd", decay_fraction=0.2)
    assert lr_factor(5, **kw) == pytest.approx(6 / 11)  # warmup as the other schedules
    assert [lr_factor(s, **kw) for s in (10, 50, 79)] == [1.0, 1.0, 1.0]
    assert lr_factor(80, **kw) == pytest.approx(1.0)
    assert lr_factor(90, **kw) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(100, **kw) == pytest.approx(0.1) and lr_factor(150, **kw) == pytest.approx(0.1)


def test_inverse_sqrt_is_continuous_after_warmup_and_floored():
    kw = dict(warmup=100, decay_steps=1000, min_ratio=0.05, kind="inverse-sqrt")
    assert lr_factor(100, **kw) == pytest.approx(1.0)
    assert lr_factor(400, **kw) == pytest.approx(0.5)  # sqrt(100 / 400)
    assert lr_factor(10_000, **kw) == pytest.approx(0.1)
    assert lr_factor(10**7, **kw) == pytest.approx(0.05)  # the floor


def test_a_wsd_run_follows_its_schedule(tiny_manifest, tmp_path):
    path = tiny_manifest(steps=10)
    variant = _load(path, "train.lr_schedule=wsd", "train.decay_fraction=0.4", "train.warmup_steps=2",
                    "train.log_every=1")
    run_variant(variant, tmp_path / "run")
    peak, floor = variant.options("optimizer").lr, variant.train.min_lr
    for record in read_metrics(tmp_path / "run" / "metrics.jsonl"):
        if "lr" in record:
            want = peak * lr_factor(record["step"], warmup=2, decay_steps=10, min_ratio=floor / peak, kind="wsd",
                                    decay_fraction=0.4)
            assert record["lr"] == pytest.approx(want), record
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "completed"
