"""The deepspeed plugin's options, the DeepSpeed config they make, and its checks (no training)."""

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from lmlab.api import Parallel, UserError
from lmlab_deepspeed.zero import DeepSpeedZeRO, base_config, merge, train_config

MANIFEST = """
name = "ds-options"

[data]
use = "text-file"
path = "{corpus}"

[model]
n_layers = 1
d_model = 16
n_heads = 2
block_size = 8

[train]
max_steps = 2
batch_size = 2

[tracker]
use = "none"

[parallel]
use = "deepspeed"
accelerator = "cpu"
{parallel}
"""


def make(**options) -> DeepSpeedZeRO:
    return DeepSpeedZeRO(DeepSpeedZeRO.Options(**options))


def lmlab(*args, cwd):
    return subprocess.run([sys.executable, "-m", "lmlab", *map(str, args)], capture_output=True, text=True, cwd=cwd)


@pytest.fixture
def manifest(tmp_path):
    (tmp_path / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog. " * 200)

    def write(parallel: str = "") -> str:
        path = tmp_path / "m.toml"
        path.write_text(MANIFEST.format(corpus=tmp_path / "corpus.txt", parallel=parallel))
        return path

    return write


def test_deepspeed_is_a_parallel_plugin_with_documented_options():
    assert issubclass(DeepSpeedZeRO, Parallel)
    for field in DeepSpeedZeRO.Options.model_fields.values():
        assert field.description


def test_options_make_the_zero_section_of_the_config():
    config = base_config(make(stage=3, offload_optimizer="cpu", offload_param="cpu", overlap_comm=False,
                              reduce_bucket_size=1000, allgather_bucket_size=2000).options)
    assert config["zero_optimization"] == {
        "stage": 3, "contiguous_gradients": True, "overlap_comm": False, "reduce_bucket_size": 1000,
        "allgather_bucket_size": 2000, "stage3_gather_16bit_weights_on_model_save": True,
        "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
    # The [optimizer] slot's torch optimizer runs under ZeRO, offloaded too (no JIT-compiled CPU Adam).
    assert config["zero_allow_untested_optimizer"] is True and config["zero_force_ds_cpu_optimizer"] is False
    assert "offload_optimizer" not in base_config(make().options)["zero_optimization"]


def test_offloading_parameters_below_stage_3_is_refused_naming_the_key():
    with pytest.raises(UserError, match="parallel.offload_param"):
        make(stage=2, offload_param="cpu")
    with pytest.raises(ValueError):
        DeepSpeedZeRO.Options(stage=4)


def test_check_refuses_offload_param_without_stage_3_with_exit_2_and_imports_no_deepspeed(manifest, tmp_path):
    result = lmlab("check", manifest("stage = 1\noffload_param = \"cpu\""), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "parallel.offload_param" in result.stderr and "Traceback" not in result.stderr
    code = ("import sys; from lmlab.cli.main import main; assert main(['check', sys.argv[1], '-q']) == 0; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in {'deepspeed', 'lightning', 'lmlab_deepspeed'}))")
    out = subprocess.run([sys.executable, "-c", code, str(manifest("stage = 3"))], capture_output=True, text=True,
                         check=True).stdout.strip().splitlines()[-1]
    assert out == "['lmlab_deepspeed', 'lmlab_deepspeed.zero']"


def test_a_config_file_setting_what_train_decides_is_refused(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"gradient_accumulation_steps": 4}))
    with pytest.raises(UserError, match="parallel.config.*train.grad_accum"):
        make(config=path)
    path.write_text(json.dumps({"bf16": {"enabled": True}}))
    with pytest.raises(UserError, match="train.precision"):
        make(config=path)
    with pytest.raises(UserError, match="parallel.config.*cannot read"):
        make(config=tmp_path / "missing.json")
    path.write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        make(config=path)


def test_run_refuses_an_unknown_deepspeed_option_with_exit_2_before_training(manifest, tmp_path):
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimisation": {"stage": 3}}))
    result = lmlab("run", manifest('config = "ds.json"'), "--out", tmp_path / "runs", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "parallel.config" in result.stderr and "unknown DeepSpeed option 'zero_optimisation'" in result.stderr
    assert "did you mean 'zero_optimization'" in result.stderr and "Traceback" not in result.stderr
    assert not list((tmp_path / "runs").rglob("metrics.jsonl"))


def test_unknown_or_invalid_options_inside_deepspeed_tables_are_named(tmp_path):
    from lmlab_deepspeed.strategy import check_config

    with pytest.raises(UserError, match=r"unknown DeepSpeed option 'zero_optimization\.offload_optimizer\.speed'"):
        check_config({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "speed": 1}}}, None)
    with pytest.raises(UserError, match=r"ds.json: DeepSpeed option 'zero_optimization\.stage'"):
        check_config({"zero_optimization": {"stage": "two"}}, tmp_path / "ds.json")
    check_config(merge(base_config(make(stage=3).options),
                       {"zero_optimization": {"stage3_max_live_parameters": 10**8}, "wall_clock_breakdown": True}), None)


def test_trainer_kwargs_build_the_strategy_with_the_file_merged_last(tmp_path, monkeypatch):
    from lmlab_deepspeed.strategy import ZeROStrategy

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # restored afterwards
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"reduce_bucket_size": 1234}, "fp16": {"hysteresis": 4}}))
    kwargs = make(devices=2, accelerator="cpu", config=path).trainer_kwargs()
    strategy = kwargs.pop("strategy")
    assert kwargs == {"accelerator": "cpu", "devices": 2, "num_nodes": 1}
    assert isinstance(strategy, ZeROStrategy) and strategy.config["zero_optimization"]["stage"] == 2
    # What [train] decides comes from the Trainer at set-up; the file then goes over it.
    strategy._lightning_module = SimpleNamespace(trainer=SimpleNamespace(accumulate_grad_batches=3,
                                                                         gradient_clip_val=0.5))
    from lightning.pytorch.plugins.precision import DeepSpeedPrecision

    strategy.precision_plugin = DeepSpeedPrecision("16-mixed")
    strategy._format_config()
    config = strategy.config
    assert config["gradient_accumulation_steps"] == 3 and config["gradient_clipping"] == 0.5
    assert config["zero_optimization"]["reduce_bucket_size"] == 1234
    assert config["fp16"] == {"enabled": True, "loss_scale": 0, "hysteresis": 4, "min_loss_scale": 1,
                              "initial_scale_power": 16, "loss_scale_window": 1000}


def test_a_loss_scaler_given_to_the_trainer_becomes_deepspeeds(monkeypatch):
    import torch
    from lightning.pytorch.plugins.precision import DeepSpeedPrecision, MixedPrecision

    from lmlab_deepspeed.strategy import ZeROStrategy

    strategy = ZeROStrategy(config=base_config(make().options))
    strategy._lightning_module = SimpleNamespace(trainer=SimpleNamespace(accumulate_grad_batches=1,
                                                                         gradient_clip_val=None))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=100)
    strategy.precision_plugin = MixedPrecision("16-mixed", "cpu", scaler=scaler)
    strategy._format_config()
    assert isinstance(strategy.precision_plugin, DeepSpeedPrecision)
    assert strategy.config["fp16"]["initial_scale_power"] == 10
    assert strategy.config["fp16"]["loss_scale_window"] == 100 and strategy.config["gradient_clipping"] == 0.0


def test_precision_maps_to_deepspeed_sections_and_its_loss_scaler_limits_are_named():
    assert "fp16" not in train_config("32-true", 1, None) and "bf16" not in train_config("32-true", 1, None)
    assert train_config("bf16-mixed", 2, 1.0)["bf16"] == {"enabled": True}
    assert train_config("16-mixed", 1, None, {"init_scale": 2.0**12})["fp16"]["initial_scale_power"] == 12
    with pytest.raises(UserError, match="train.loss_scale_init"):
        train_config("16-mixed", 1, None, {"init_scale": 1000.0})
    with pytest.raises(UserError, match="train.loss_scale_backoff"):
        train_config("16-mixed", 1, None, {"backoff_factor": 0.25})
    with pytest.raises(UserError, match="train.precision"):
        train_config("64-true", 1, None)


def test_shards_no_checkpoint_file_names_are_pruned(tmp_path):
    import torch

    from lmlab_deepspeed.strategy import prune_shards

    for tag in ("step10-a", "step20-b", "step30-c"):
        (tmp_path / "deepspeed" / tag).mkdir(parents=True)
    torch.save({"deepspeed": {"shards": "deepspeed/step30-c"}}, tmp_path / "last.ckpt")
    torch.save({"deepspeed": {"shards": "deepspeed/step10-a"}}, tmp_path / "best.ckpt")
    torch.save({"deepspeed": {"shards": "deepspeed/step20-b"}}, tmp_path / ".last.ckpt.tmp")  # a killed save
    prune_shards(tmp_path)
    assert sorted(p.name for p in (tmp_path / "deepspeed").iterdir()) == ["step10-a", "step30-c"]


def test_memory_savings_are_valid_options_that_shard_more_and_more():
    # An out-of-memory diagnosis prints them as --set parallel.KEY=VALUE: each must validate as it is.
    savings = DeepSpeedZeRO.memory_savings()
    stages = [DeepSpeedZeRO.Options(**options).stage for _, options in savings]
    assert stages == sorted(stages) and stages[:3] == [1, 2, 3]
    assert all(f"stage {stage}" in what for (what, _), stage in zip(savings, stages))
