import pytest

from lmlab.api import Parallel, UserError
from lmlab_modelparallel.tensor import TensorParallel

pytestmark = pytest.mark.exclusive  # several processes at once


def make(**options) -> TensorParallel:
    return TensorParallel(TensorParallel.Options(**options))


def test_tensor_is_a_parallel_plugin_with_documented_options():
    assert issubclass(TensorParallel, Parallel)
    for field in TensorParallel.Options.model_fields.values():
        assert field.description


def test_tensor_lays_processes_out_as_data_parallel_times_tensor_parallel_and_saves_one_full_file():
    from lightning.pytorch.strategies import ModelParallelStrategy

    kwargs = make(devices=4, accelerator="cpu", tensor_parallel_size=2).trainer_kwargs()
    strategy = kwargs.pop("strategy")
    assert kwargs == {"accelerator": "cpu", "devices": 4, "num_nodes": 1}
    assert isinstance(strategy, ModelParallelStrategy)
    assert (strategy._data_parallel_size, strategy._tensor_parallel_size) == (2, 2)
    assert strategy._save_distributed_checkpoint is False  # what lmlab generate reads


def test_tensor_parallel_size_defaults_to_one_node_and_must_divide_the_processes():
    assert make(devices=2, num_nodes=3, accelerator="cpu").sizes() == ("cpu", 2, 3, 2)
    with pytest.raises(UserError, match="parallel.tensor_parallel_size"):
        make(devices=3, accelerator="cpu", tensor_parallel_size=2).trainer_kwargs()


def test_heads_that_tensor_parallelism_cannot_split_stop_the_run_before_it_starts(manifest, lmlab, refused):
    # 3 processes, 3-way: 4 heads do not split 3 ways. Refused in the main process, before launching.
    path = manifest('use = "tensor"\ndevices = 3\naccelerator = "cpu"\ntensor_parallel_size = 3')
    line = refused(lmlab("run", str(path), "--out", str(path.parent / "out")), "parallel.tensor_parallel_size")
    assert "4 query heads" in line


def test_an_attention_plugin_without_a_plan_is_named(manifest, lmlab, refused):
    from importlib.metadata import entry_points

    if not entry_points(group="lmlab.attention", name="mamba"):
        pytest.skip("lmlab-mamba is not installed")
    path = manifest('use = "tensor"\ndevices = 2\naccelerator = "cpu"\ntensor_parallel_size = 2',
                    extra='\n[attention]\nuse = "mamba"\n')
    line = refused(lmlab("run", str(path), "--out", str(path.parent / "out")), "attention.use")
    assert "tensor_parallel_plan" in line


def test_tensor_parallel_on_two_processes_trains_exactly_what_one_device_does(tmp_path):
    from lmlab.testing import check_parallel_matches_single

    # Both processes form one tensor-parallel group: one replica, the same batch as one device.
    # GQA (2 kv heads: one per rank), SwiGLU and RoPE. Measured: the largest difference over 20 steps is about 2e-7 (float32 summation order).
    architecture = '\n[attention]\nuse = "gqa"\nn_kv_heads = 2\n\n[ffn]\nuse = "swiglu"\n\n[position]\nuse = "rope"\n'
    check_parallel_matches_single('use = "tensor"\ndevices = 2\naccelerator = "cpu"\ntensor_parallel_size = 2',
                                  tmp_path, replicas=1, processes=2, atol=1e-5, extra_manifest=architecture)


@pytest.mark.slow
def test_fsdp_times_tensor_parallel_on_four_processes_trains_what_one_device_does(tmp_path):
    from lmlab.testing import check_parallel_matches_single

    # 2 data-parallel replicas (FSDP over them) × 2-way tensor parallelism. Measured: about 5e-7;
    # about two minutes on two cores, hence slow.
    check_parallel_matches_single('use = "tensor"\ndevices = 4\naccelerator = "cpu"\ntensor_parallel_size = 2',
                                  tmp_path, replicas=2, processes=4, atol=1e-5)


def test_the_memory_layout_splits_the_blocks_weights_over_the_group_and_shards_all_over_replicas(toy_model):
    model = toy_model(4)  # 1000 embedding + 4 × (100 + 200) in blocks = 2200
    alone = make(devices=2, tensor_parallel_size=2).memory_layout(model, None, "32-true")
    assert (alone.devices, alone.data_parallel) == (2, 2 // 2)
    assert alone.params == pytest.approx((1200 / 2 + 1000) / 2200)
    assert [c.op for c in alone.collectives] == ["all-reduce"] and alone.collectives[0].group == 2
    two_d = make(devices=2, tensor_parallel_size=2).memory_layout(model, 8, "32-true")
    assert two_d.data_parallel == 4 and two_d.params == pytest.approx(alone.params / 4)
    with pytest.raises(UserError, match="parallel.tensor_parallel_size"):
        make(devices=4, tensor_parallel_size=4).memory_layout(model, 6, "32-true")
