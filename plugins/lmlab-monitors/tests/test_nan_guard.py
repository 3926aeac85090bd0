"""nan-guard against a NaN injected into one named module at a known step: caught at that step with
that module named, and each action ends as configured."""

import json
import math

import pytest
import torch

from lmlab.api import RunFailed, hookimpl
from lmlab.testing.runs import main
from lmlab.testing.runs import load_variant, lr_at, run_variant


class InjectNaN:
    """Makes ``module``'s forward output NaN at the optimizer steps ``steps`` (1-based, as
    ``lmlab_train_batch_end`` counts them), in training mode only."""

    def __init__(self, module: str, steps):
        self.module, self.steps = module, set(steps)
        self.completed = 0  # optimizer steps done: the forward in flight belongs to step completed + 1
        self.poisoned = []

    @hookimpl
    def lmlab_model_built(self, model):
        def hook(mod, args, output):
            if mod.training and self.completed + 1 in self.steps:
                self.poisoned.append(self.completed + 1)
                return output * float("nan")
            return None

        model.get_submodule(self.module).register_forward_hook(hook)

    @hookimpl
    def lmlab_train_batch_end(self, step):
        self.completed = step


def _variant(tiny_manifest, guard: str, steps: int = 8):
    path = tiny_manifest(f'\n[monitor]\nuse = ["nan-guard"]\n\n[monitor.nan-guard]\n{guard}\n', steps=steps,
                         checkpoint_every=2)
    variant = load_variant(path)
    return variant


def test_stop_names_the_module_at_the_step(tiny_manifest, tmp_path):
    variant = _variant(tiny_manifest, 'action = "stop"')
    probe = InjectNaN("blocks.1.ffn", steps=[4])
    run_dir = tmp_path / "runs" / "default"
    with pytest.raises(RunFailed) as failed:
        run_variant(variant, run_dir, extra_hooks=[probe])
    diagnosis = failed.value.diagnosis
    assert diagnosis.kind == "non-finite"
    assert "step 4" in diagnosis.cause and "blocks.1.ffn (forward output)" in diagnosis.cause
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["steps"] == 3  # step 4 never applied
    recorded = summary["diagnosis"]
    assert recorded["kind"] == "non-finite"
    assert "first non-finite: blocks.1.ffn (forward output)" in recorded["evidence"]
    assert any(e.startswith("learning rate then:") for e in recorded["evidence"])
    assert any(e.startswith("gradient clipping: on") for e in recorded["evidence"])
    assert any(f["key"] == "optimizer.lr" for f in recorded["fixes"])
    assert summary["first_nonfinite"] == {"step": 4, "what": "the loss is nan", "module": "blocks.1.ffn (forward output)"}
    # The checkpoint of step 2 is the last one, and finite.
    state = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert state["global_step"] == 2
    assert all(torch.isfinite(v).all() for v in state["state_dict"].values() if v.is_floating_point())


def test_stop_from_the_cli_exits_1_and_prints_the_diagnosis(tiny_manifest, tmp_path, capsys, monkeypatch):
    path = tiny_manifest('\n[monitor]\nuse = ["nan-guard"]\n\n[optimizer]\nuse = "adamw"\nlr = 1e6\n', steps=6)
    code = main(["run", str(path), "--out", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    assert code == 1
    assert "diagnosis: non-finite" in err and "fix:" in err and "--set optimizer.lr=" in err


def test_skip_goes_on_and_rolls_back_after_k(tiny_manifest, tmp_path):
    variant = _variant(tiny_manifest, 'action = "skip"\nrollback_after = 2\nlr_factor = 0.5', steps=10)
    probe = InjectNaN("blocks.0.attn", steps=[5, 6])
    run_dir = tmp_path / "runs" / "default"
    lrs = []

    class LR:
        @hookimpl
        def lmlab_train_batch_end(self, step, control):
            lrs.append((step, control.lr))

    result = run_variant(variant, run_dir, extra_hooks=[probe, LR()])
    summary = result.summary
    assert summary["status"] == "completed" and summary["steps"] == 10
    assert probe.poisoned[:1] == [5]
    assert summary["skipped_steps"] == 2 and summary["nonfinite_steps"] == 2
    (rollback,) = summary["rollbacks"]
    assert rollback["at_step"] == 6 and rollback["to_step"] == 4 and rollback["lr_factor"] == 0.5
    assert summary["first_nonfinite"]["module"] == "blocks.0.attn (forward output)"
    # The schedule's learning rate halves from the rollback on: compare with the same run's schedule.
    for step, lr in lrs:
        assert lr == pytest.approx(lr_at(variant, step) * (0.5 if step >= 6 else 1.0), rel=1e-6), step
    assert math.isfinite(summary["val_loss"])
    for name in ("last.ckpt", "best.ckpt"):
        state = torch.load(run_dir / "checkpoints" / name, weights_only=True)
        assert all(torch.isfinite(v).all() for v in state["state_dict"].values() if v.is_floating_point())


def test_skip_leaves_weights_and_optimizer_state_untouched(tiny_manifest, tmp_path):
    variant = _variant(tiny_manifest, 'action = "skip"\nrollback_after = 0', steps=4)
    probe = InjectNaN("blocks.1.ffn", steps=[4])
    seen = {}

    class Snapshot:
        @hookimpl
        def lmlab_train_batch_end(self, step, model):
            seen[step] = {k: v.detach().clone() for k, v in model.state_dict().items()}

    result = run_variant(variant, tmp_path / "run", extra_hooks=[probe, Snapshot()])
    assert result.summary["skipped_steps"] == 1
    for key, value in seen[4].items():
        assert torch.equal(value, seen[3][key]), key


def test_rollback_is_refused_for_a_sharded_layout(tiny_manifest, capsys):
    path = tiny_manifest('\n[monitor]\nuse = ["nan-guard"]\n\n[monitor.nan-guard]\naction = "skip"\n'
                         '\n[parallel]\nuse = "fsdp"\n')
    assert main(["check", str(path)]) == 2
    assert "monitor.nan-guard.rollback_after" in capsys.readouterr().err


def test_skip_before_the_first_checkpoint_skips_instead_of_failing(tiny_manifest, tmp_path):
    """Bad steps before any checkpoint exists: skip needs none. The weights stay as the last good step
    left them (finite, as every bad step was skipped), and the rollback only lowers the rate."""
    path = tiny_manifest('\n[monitor]\nuse = ["nan-guard"]\n\n[monitor.nan-guard]\naction = "skip"\n'
                         'rollback_after = 2\n', steps=6, checkpoint_every=5)
    probe = InjectNaN("blocks.0.attn", steps=[2, 3])
    run_dir = tmp_path / "runs" / "default"
    result = run_variant(load_variant(path), run_dir, extra_hooks=[probe])
    summary = result.summary
    assert summary["status"] == "completed" and summary["steps"] == 6
    assert probe.poisoned[:1] == [2]
    assert summary["skipped_steps"] == 2 and summary["nonfinite_steps"] == 2
    (rollback,) = summary["rollbacks"]
    assert rollback["at_step"] == 3 and rollback["to_step"] == 2 and rollback["lr_factor"] == 0.5
    assert "no checkpoint yet" in (run_dir / "warnings.log").read_text()
    assert math.isfinite(summary["val_loss"]) and math.isfinite(summary["train_loss"])
