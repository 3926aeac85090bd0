"""Training options that change the loop: gradient accumulation, mixed precision, schedules, DDP."""

import json

import pytest

from lmlab.cli.main import main
from lmlab.train.schedule import lr_factor

from support import run_cli


def summary(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


def test_grad_accumulation_and_bf16_mixed_train_to_completion(tiny_manifest, tmp_path):
    out = tmp_path / "runs"
    assert main(["run", str(tiny_manifest(steps=4, eval_every=2)), "--out", str(out), "--set", "train.grad_accum=3",
                 "--set", "train.precision=bf16-mixed", "--set", "train.sample_tokens=0"]) == 0
    s = summary(out / "default")
    assert s["status"] == "completed" and s["steps"] == 4
    records = [json.loads(line) for line in (out / "default" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "train_loss" in r] == [2, 4]  # optimizer steps, not micro-batches


def test_warmup_then_cosine_matches_nanogpt():
    kw = dict(warmup=100, decay_steps=2000, min_ratio=0.1, kind="cosine")
    assert lr_factor(0, **kw) == pytest.approx(1 / 101)  # nanoGPT: lr * (it + 1) / (warmup + 1)
    assert lr_factor(100, **kw) == pytest.approx(1.0)
    assert lr_factor(1050, **kw) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(2000, **kw) == pytest.approx(0.1) and lr_factor(5000, **kw) == pytest.approx(0.1)
    assert lr_factor(1050, **{**kw, "kind": "linear"}) == pytest.approx(0.55)
    assert lr_factor(1500, **{**kw, "kind": "constant"}) == 1.0


@pytest.mark.exclusive
def test_ddp_on_two_cpu_processes_from_a_manifest(tiny_manifest, tmp_path):
    path = tiny_manifest('[parallel]\nuse = "ddp"\ndevices = 2\naccelerator = "cpu"\n', steps=4, eval_every=2)
    result = run_cli("run", str(path), "--out", str(tmp_path / "runs"), "--set", "train.sample_tokens=4")
    assert result.returncode == 0, result.stderr
    s = summary(tmp_path / "runs" / "default")
    assert s["status"] == "completed" and s["steps"] == 4 and s["plugins"]["parallel"]["name"] == "ddp"
    assert result.stdout.count("--- sample") == 1  # only the main process reports
    assert result.stderr.count("[1/1]") == 1


def test_compile_trains_like_eager_and_reports_compile_time_apart(tiny_manifest, tmp_path):
    path = tiny_manifest(steps=6, eval_every=6)
    for name, compile_ in (("eager", "false"), ("compiled", "true")):
        assert main(["run", str(path), "--out", str(tmp_path / name), "--set", f"train.compile={compile_}",
                     "--set", "train.sample_tokens=0"]) == 0
    eager, compiled = summary(tmp_path / "eager" / "default"), summary(tmp_path / "compiled" / "default")
    assert "compile_s" not in eager and compiled["compile_s"] > 0
    assert abs(compiled["val_loss"] - eager["val_loss"]) < 1e-3


@pytest.mark.parametrize("policy", ["ffn", "full"])
def test_checkpointing_policies_train_to_the_same_loss(tiny_manifest, tmp_path, policy):
    path = tiny_manifest(steps=4, eval_every=4)
    for name in ("none", policy):
        assert main(["run", str(path), "--out", str(tmp_path / name), "--set", f"train.checkpointing={name}",
                     "--set", "train.sample_tokens=0"]) == 0
    assert summary(tmp_path / policy / "default")["val_loss"] == pytest.approx(
        summary(tmp_path / "none" / "default")["val_loss"], abs=1e-5)
