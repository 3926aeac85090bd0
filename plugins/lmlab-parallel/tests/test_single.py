import pytest
import torch

from lmlab.api import Parallel, UserError
from lmlab_parallel.single import SingleDevice


def make(**options) -> SingleDevice:
    return SingleDevice(SingleDevice.Options(**options))


def test_single_is_a_parallel_plugin_with_documented_options():
    assert issubclass(SingleDevice, Parallel)
    for field in SingleDevice.Options.model_fields.values():
        assert field.description


def test_single_on_cpu_runs_one_process_on_one_device():
    kwargs = make(accelerator="cpu").trainer_kwargs()
    assert kwargs == {"strategy": "auto", "accelerator": "cpu", "devices": 1, "num_nodes": 1}


def test_single_auto_picks_the_cpu_when_no_gpu_is_present(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert make().trainer_kwargs()["accelerator"] == "cpu"


def test_single_auto_picks_the_chosen_cuda_device_as_an_index_list(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    kwargs = make(device=2).trainer_kwargs()
    # A list means "device number 2"; a bare int would mean "two devices".
    assert kwargs == {"strategy": "auto", "accelerator": "cuda", "devices": [2], "num_nodes": 1}


def test_single_refuses_a_device_index_the_machine_lacks(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(UserError, match="parallel.device"):
        make(accelerator="cuda", device=1).trainer_kwargs()


def test_single_refuses_an_unavailable_accelerator_naming_the_key(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(UserError, match="parallel.accelerator"):
        make(accelerator="gpu").trainer_kwargs()


def test_single_options_refuse_unknown_accelerators_and_negative_devices():
    with pytest.raises(ValueError):
        SingleDevice.Options(accelerator="tpu")
    with pytest.raises(ValueError):
        SingleDevice.Options(device=-1)


def test_single_kwargs_build_a_lightning_trainer_on_one_cpu_device(tmp_path):
    import lightning

    trainer = lightning.Trainer(**make(accelerator="cpu").trainer_kwargs(), logger=False,
                                default_root_dir=tmp_path, enable_progress_bar=False)
    assert trainer.world_size == 1
    assert trainer.strategy.root_device == torch.device("cpu")
