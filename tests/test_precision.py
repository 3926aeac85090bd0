"""``[train] precision`` and the loss scaler of 16-mixed: bf16 autocast trains like float32 on the
CPU, 16-mixed (GPUs only) is refused there by name (by the parallel plugin's check), and the
loss_scale_* options reach the scaler each parallel plugin sets up (``Parallel.trainer_precision``)."""

import json

import pytest
import torch

from lmlab.cli.main import main
from lmlab.config import TrainOptions
from lmlab.errors import UserError
from lmlab import discovery
from lmlab.api import CheckContext, ModelShape
from lmlab.train.runner import _trainer
from lmlab.testing import stand_in_run


def losses(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["train_loss"] for r in map(json.loads, lines) if "train_loss" in r]


def test_bf16_mixed_trains_on_the_cpu_within_a_sane_distance_of_float32(tiny_manifest, tmp_path):
    path = tiny_manifest(steps=30, eval_every=30, checkpoint_every=30)
    for precision in ("32-true", "bf16-mixed"):
        assert main(["run", str(path), "--out", str(tmp_path / precision), "--set", f"train.precision={precision}",
                     "--set", "train.log_every=1", "--set", "train.sample_tokens=0"]) == 0
    fp32, bf16 = losses(tmp_path / "32-true" / "default"), losses(tmp_path / "bf16-mixed" / "default")
    assert len(fp32) == len(bf16) == 30
    assert bf16[-1] < bf16[0] - 0.3  # it learns
    # Measured: at most 7e-4 apart over 30 steps (bf16 keeps 8 bits of mantissa, ~4e-3 relative per
    # product, which the sums and the mean over tokens average down); a broken autocast or lost
    # gradients differ by 1e-1 and more.
    assert max(abs(a - b) for a, b in zip(fp32, bf16)) < 1e-2


def test_16_mixed_on_the_cpu_is_bad_input_naming_train_precision(tiny_manifest, tmp_path, capsys):
    # Lightning would quietly train bf16-mixed instead: refuse rather than mislabel the run.
    assert main(["run", str(tiny_manifest()), "--out", str(tmp_path / "runs"),
                 "--set", "train.precision=16-mixed"]) == 2
    err = capsys.readouterr().err
    assert "train.precision" in err and "bf16-mixed" in err and "Traceback" not in err


@pytest.fixture
def on_a_gpu_machine(monkeypatch):
    # The scaler objects are built, never used: they need CUDA to be there, not to work.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def parallel(name: str, **options):
    cls = discovery.load("parallel", name)
    return cls(cls.Options(**options))


def scaler_options(**values) -> TrainOptions:
    return TrainOptions(precision="16-mixed", **values)


def test_the_loss_scaler_defaults_are_torchs(on_a_gpu_machine):
    (plugin,) = parallel("single", accelerator="gpu").trainer_precision(scaler_options())["plugins"]
    assert (plugin.scaler.get_scale(), plugin.scaler.get_growth_interval(), plugin.scaler.get_backoff_factor()) == (
        2.0**16, 2000, 0.5)


@pytest.mark.parametrize("name, options", [("single", {}), ("ddp", {"devices": 2}), ("fsdp", {"devices": 2}),
                                           ("tensor", {"devices": 2})])
def test_loss_scale_options_reach_the_grad_scaler_of_the_mixed_precision_plugin(on_a_gpu_machine, name, options):
    from lightning.pytorch.plugins.precision import MixedPrecision

    if not any(p.name == name for p in discovery.installed()["parallel"]):
        pytest.skip(f"the {name} plugin is not installed")
    cfg = scaler_options(loss_scale_init=1024.0, loss_scale_growth_interval=10, loss_scale_backoff=0.25)
    kwargs = parallel(name, accelerator="cuda", **options).trainer_precision(cfg)
    assert "precision" not in kwargs  # the plugin replaces the flag (which ModelParallelStrategy refuses)
    (plugin,) = kwargs["plugins"]
    assert isinstance(plugin, MixedPrecision) and plugin.precision == "16-mixed" and plugin.device == "cuda"
    assert type(plugin.scaler) is torch.amp.GradScaler
    assert plugin.scaler.get_scale() == 1024.0
    assert plugin.scaler.get_growth_interval() == 10
    assert plugin.scaler.get_backoff_factor() == 0.25


def test_deepspeed_takes_the_precision_as_it_is_its_engine_scales_the_loss(on_a_gpu_machine):
    if not any(p.name == "deepspeed" for p in discovery.installed()["parallel"]):
        pytest.skip("the deepspeed plugin is not installed")
    assert parallel("deepspeed", accelerator="cuda").trainer_precision(scaler_options()) == {"precision": "16-mixed"}


def test_other_precisions_pass_through_as_lightnings_flag():
    for precision in ("32-true", "bf16-mixed", "bf16-true", "64-true"):
        assert parallel("single", accelerator="cpu").trainer_precision(TrainOptions(precision=precision)) == {
            "precision": precision}


def test_16_mixed_is_refused_for_the_cpu_before_anything_is_built():
    context = CheckContext(shape=ModelShape(n_layers=1, d_model=8, n_heads=2, block_size=8, vocab_size=16),
                           plugins={}, manifest={}, run=stand_in_run(train={"precision": "16-mixed"}))
    with pytest.raises(UserError, match="train.precision"):
        parallel("single", accelerator="cpu").check(context)
    parallel("single", accelerator="cpu").check(CheckContext(**{**vars(context), "machine": False}))  # plan: no machine


def test_the_built_trainer_autocasts_bf16_on_the_cpu_without_a_scaler(tmp_path):
    import lightning
    from lightning.pytorch.plugins.precision import MixedPrecision

    cfg = TrainOptions(precision="bf16-mixed")
    trainer = _trainer(cfg, cfg.grad_clip, tmp_path, lightning.Callback(), {"strategy": "auto", "accelerator": "cpu", "devices": 1},
                       parallel("single", accelerator="cpu").trainer_precision(cfg))
    plugin = trainer.precision_plugin
    assert isinstance(plugin, MixedPrecision) and plugin.precision == "bf16-mixed" and plugin.scaler is None


def test_loss_scale_options_are_validated():
    for bad in ({"loss_scale_init": 0}, {"loss_scale_growth_interval": 0}, {"loss_scale_backoff": 1.0},
                {"loss_scale_backoff": 0}):
        with pytest.raises(ValueError):
            TrainOptions(**bad)


@pytest.mark.parametrize("algorithm", [None, "value"])
def test_a_fused_optimizer_is_clipped_by_the_module_where_lightnings_mixed_precision_refuses(algorithm):
    """AdamW runs fused by default; Lightning's mixed-precision plugins refuse to clip for an optimizer
    that unscales in its step, so the module clips itself, as torch's own clipping would."""
    from lmlab.train.module import LMModule

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    assert optimizer._step_supports_amp_scaling
    model(torch.randn(3, 4)).pow(2).sum().mul(100).backward()
    reference = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
    for r, p in zip(reference, model.parameters()):
        r.grad = p.grad.clone()
    before = model.weight.grad.clone()
    (torch.nn.utils.clip_grad_norm_ if algorithm is None else torch.nn.utils.clip_grad_value_)(reference, 0.5)
    LMModule(model, None, None, None, None).configure_gradient_clipping(optimizer, 0.5, algorithm)
    for p, r in zip(model.parameters(), reference):
        assert torch.equal(p.grad, r.grad)
    assert not torch.equal(model.weight.grad, before)  # the gradients were large enough to be clipped
