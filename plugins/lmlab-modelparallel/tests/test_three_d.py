"""The ``3d`` plugin: pipeline × data × tensor parallelism on one mesh, checked against one device,
with its checkpoints loaded into other layouts and its bad degrees refused at ``lmlab check``."""

import os
import subprocess
import sys

import pytest
import torch

from lmlab.api import Parallel, UserError
from lmlab.testing.parallel import loss_trajectory
from lmlab_modelparallel.three_d import ThreeD

CUBE = 'use = "3d"\ndevices = 8\naccelerator = "cpu"\npipeline = 2\ndata = 2\ntensor = 2'


def make(**options) -> ThreeD:
    return ThreeD(ThreeD.Options(**options))


def test_3d_is_a_pipeline_that_runs_forward_and_backward_itself_with_documented_options():
    assert issubclass(ThreeD, Parallel) and ThreeD.runs_forward_backward
    for field in ThreeD.Options.model_fields.values():
        assert field.description


def test_the_mesh_is_pipeline_data_tensor_outermost_first_and_replicas_are_the_data_degree():
    plugin = make(devices=8, accelerator="cpu", pipeline=2, data=2, tensor=2)
    kwargs = plugin.trainer_kwargs()
    strategy = kwargs.pop("strategy")
    assert kwargs == {"accelerator": "cpu", "devices": 8, "num_nodes": 1}
    assert strategy.layout == (2, 2, 2)
    assert plugin.data_parallel_replicas() == 2


@pytest.mark.parametrize("degrees, key, says", [
    ("pipeline = 2\ndata = 2\ntensor = 2\ndevices = 6", "parallel.devices", "= 8, but the run has 6 processes"),
    ("tensor = 3\ndevices = 3", "parallel.tensor", "must divide the 4 query heads"),
    ("pipeline = 3\ndevices = 3", "parallel.pipeline", "model.n_layers is 2"),
    ("pipeline = 2\ntensor = 2\ndevices = 4\nn_microbatches = 3", "parallel.n_microbatches", "must divide"),
])
def test_degrees_the_run_cannot_take_stop_lmlab_check_naming_the_option(manifest, lmlab, refused, degrees, key, says):
    path = manifest(f'use = "3d"\naccelerator = "cpu"\n{degrees}')  # 2 blocks of 4 heads
    assert says in refused(lmlab("check", str(path)), key)


def test_lmlab_plan_refuses_a_device_count_the_degrees_do_not_make(toy_model):
    with pytest.raises(UserError, match="parallel.devices"):
        make(pipeline=2, data=2, tensor=2).memory_layout(toy_model(4), 6, "32-true")


def test_the_memory_layout_is_the_fullest_stage_split_by_tensor_and_sharded_by_data(toy_model):
    model = toy_model(4)  # 1000 embedding (tied head) + 4 × (100 attention + 200 ffn) = 2200
    layout = make(pipeline=2, data=4, tensor=2, n_microbatches=4).memory_layout(model, 16, "32-true")
    # Either stage: 2 blocks split two ways (300) plus the embedding (1000), of 2200; FSDP 4 ways.
    assert layout.devices == 16 and layout.replicas == 4
    assert layout.params == layout.grads == layout.optimizer == pytest.approx(1300 / 2200 / 4)
    assert layout.gathered == pytest.approx(1300 / 2200 * 3 / 4)
    # 1F1B: the first stage holds 2 of 4 micro-batches of half the blocks, at (10 + 24 / 2) / 34.
    assert layout.activations == pytest.approx(0.5 * 2 / 4 * 22 / 34)
    ops = {(c.op, c.of): c for c in layout.collectives}
    assert ops["all-reduce", "activations"].group == 2 and ops["all-reduce", "activations"].size == 8
    assert ops["send-recv", "activations"].size == 2
    assert ops["all-gather", "parameters"].group == 4
    assert ops["reduce-scatter", "gradients"].size == pytest.approx(1300 / 2200)
    # One degree alone is that layout alone: no data parallelism gathers nothing.
    alone = make(pipeline=2, n_microbatches=4).memory_layout(model, 2, "32-true")
    assert alone.gathered == 0 and {c.op for c in alone.collectives} == {"send-recv"}


def _run(args: list[str], timeout: int = 900) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "lmlab", *args], capture_output=True, text=True, timeout=timeout,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.slow  # 8 processes on two cores, then two runs from its weights: about three minutes
def test_2x2x2_on_8_processes_trains_what_one_device_does_and_its_checkpoint_loads_anywhere(tmp_path):
    from lmlab.testing import check_parallel_matches_single

    # Both runs clip at 0.05 (every step clips: the global norm decides) and accumulate two
    # micro-batches. Measured: within 5e-7 over 20 steps (float32 rounding of the micro-batch and
    # shard sums); a wrong replica average, a missed clip or a stage's lost gradient differ by 1e-2.
    check_parallel_matches_single(CUBE, tmp_path, replicas=2, processes=8, steps=20, atol=1e-5,
                                  extra_train="grad_clip = 0.05\ngrad_accum = 2")
    single, cube = tmp_path / "single" / "default", tmp_path / "parallel" / "default"
    # The consolidated checkpoint is the single-device state dict, every stage's shards gathered.
    mine = torch.load(cube / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    theirs = torch.load(single / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    assert mine.keys() == theirs.keys()
    for name in theirs:
        assert torch.allclose(mine[name], theirs[name], atol=1e-5), name
    # [init] from the 3-D run into one device and into a pipeline × tensor layout: the same first loss.
    base = (tmp_path / "single.toml").read_text().replace("max_steps = 20", "max_steps = 1")
    first = {}
    for name, table in (("one", ""), ("other", '[parallel]\nuse = "3d"\ndevices = 4\naccelerator = "cpu"\n'
                                                'pipeline = 2\ntensor = 2')):
        path = tmp_path / f"{name}.toml"
        path.write_text(f'{base}\n[init]\nfrom = "{cube}"\n{table}\n')
        _run(["run", str(path), "--out", str(tmp_path / name)])
        first[name] = loss_trajectory(tmp_path / name / "default")[0]
    fresh = loss_trajectory(single)[0]
    assert first["one"] == pytest.approx(first["other"], abs=1e-5)
    assert abs(first["one"] - fresh) > 0.05  # the trained weights were loaded, not a fresh model
