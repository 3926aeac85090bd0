import json
import os

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lmlab.api import Parallel, UserError
from lmlab_parallel.ddp import DistributedDataParallel as DDP


def make(**options) -> DDP:
    return DDP(DDP.Options(**options))


def test_ddp_is_a_parallel_plugin_with_documented_options():
    assert issubclass(DDP, Parallel)
    for field in DDP.Options.model_fields.values():
        assert field.description


def test_ddp_defaults_launch_by_subprocess_script_and_let_lightning_pick_the_backend():
    from lightning.pytorch.strategies import DDPStrategy

    kwargs = make().trainer_kwargs()
    strategy = kwargs.pop("strategy")
    assert kwargs == {"accelerator": "auto", "devices": "auto", "num_nodes": 1}
    assert isinstance(strategy, DDPStrategy)
    assert strategy._start_method == "popen"  # what torchrun and SLURM need
    assert strategy._process_group_backend is None
    assert strategy._ddp_kwargs == {"find_unused_parameters": False, "static_graph": False,
                                    "gradient_as_bucket_view": True}


def test_ddp_forwards_every_option_to_lightning_and_torch_ddp(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a machine with the 4 GPUs asked for
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    kwargs = make(devices=4, num_nodes=2, accelerator="cuda", backend="gloo", start_method="spawn",
                  find_unused_parameters=True, static_graph=True,
                  gradient_as_bucket_view=False).trainer_kwargs()
    strategy = kwargs.pop("strategy")
    assert kwargs == {"accelerator": "cuda", "devices": 4, "num_nodes": 2}
    assert strategy._start_method == "spawn"
    assert strategy._process_group_backend == "gloo"
    assert strategy._ddp_kwargs == {"find_unused_parameters": True, "static_graph": True,
                                    "gradient_as_bucket_view": False}


def test_ddp_refuses_devices_the_machine_lacks_before_the_run_starts(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match="parallel.accelerator"):
        make(devices=4, accelerator="gpu").trainer_kwargs()


def test_ddp_options_refuse_zero_devices_and_unknown_start_methods():
    for bad in ({"devices": 0}, {"devices": "all"}, {"num_nodes": 0}, {"start_method": "thread"}):
        with pytest.raises(ValueError):
            DDP.Options(**bad)


class _Regression:  # built lazily so collecting this file does not import lightning
    @staticmethod
    def module(out_dir):
        import lightning

        class LinearRegression(lightning.LightningModule):
            def __init__(self):
                super().__init__()
                self.linear = torch.nn.Linear(4, 1)
                self.seen: list[int] = []

            def training_step(self, batch, batch_idx):
                index, x, y = batch  # (B,), (B, 4), (B, 1)
                self.seen += index.tolist()
                return torch.nn.functional.mse_loss(self.linear(x), y)

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)

            def on_train_end(self):
                record = {"rank": self.global_rank, "world_size": self.trainer.world_size,
                          "seen": self.seen, "weights": [p.detach().flatten().tolist() for p in self.parameters()]}
                (out_dir / f"rank{self.global_rank}.json").write_text(json.dumps(record))

        return LinearRegression()


@pytest.mark.exclusive
def test_ddp_on_two_cpu_processes_shards_the_data_and_keeps_replicas_identical(tmp_path, monkeypatch):
    import lightning

    if torch.cuda.is_initialized():
        pytest.skip("Lightning refuses to fork once CUDA is initialised in this process")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    saved_env, saved_threads = dict(os.environ), torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(64, 4)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    loader = DataLoader(TensorDataset(torch.arange(64), x, y), batch_size=4)
    model = _Regression.module(tmp_path)
    before = [p.detach().clone() for p in model.parameters()]
    try:
        trainer = lightning.Trainer(
            **make(devices=2, accelerator="cpu", start_method="fork").trainer_kwargs(),
            max_steps=5, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, default_root_dir=tmp_path)
        trainer.fit(model, loader)
    finally:
        # Lightning sets MASTER_ADDR/PORT etc. in this process; leave nothing behind for other tests.
        os.environ.clear()
        os.environ.update(saved_env)
        torch.set_num_threads(saved_threads)

    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    seen0, seen1 = set(ranks[0]["seen"]), set(ranks[1]["seen"])
    assert len(seen0) == len(seen1) == 5 * 4  # max_steps batches of 4 on each rank
    assert not seen0 & seen1  # the DistributedSampler gave each rank its own shard
    # Different data but the same weights: the gradients were all-reduced every step.
    assert ranks[0]["weights"] == ranks[1]["weights"]
    assert ranks[0]["weights"] != [p.flatten().tolist() for p in before]


@pytest.mark.exclusive
def test_ddp_on_two_processes_trains_exactly_what_one_device_does_on_the_global_batch(tmp_path):
    from lmlab.testing import check_parallel_matches_single

    # Measured: the largest difference over 20 steps is about 1e-6 (float32 summation order).
    check_parallel_matches_single('use = "ddp"\ndevices = 2\naccelerator = "cpu"', tmp_path, atol=1e-5)


def test_ddp_waits_timeout_s_for_a_collective():
    from datetime import timedelta

    assert make(timeout_s=12).trainer_kwargs()["strategy"]._timeout == timedelta(seconds=12)
    assert make().trainer_kwargs()["strategy"]._timeout == timedelta(minutes=30)  # torch's default
