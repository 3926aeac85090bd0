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

pytestmark = pytest.mark.exclusive  # several processes at once

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
    whole = torch.load(cube / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert_blocks_split_over_tensor_ranks(whole["optimizer_states"][0], (2, 2, 2))
    # The consolidated checkpoint is the single-device state dict, every stage's shards gathered.
    mine = whole["state_dict"]
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


def assert_blocks_split_over_tensor_ranks(optimizer_state: dict, layout: tuple[int, int, int],
                                          d_model: int = 32, n_layers: int = 2) -> None:
    """Each rank holds 1/t of its stage's attention and ffn weights, and the t ranks of a tensor group
    hold different slices. A tensor degree that split nothing would still train what one device does,
    so the losses cannot show it; the optimizer state can: it is kept per rank, as that rank's shards
    (``PipelineStrategy.optimizer_state``)."""
    p, d, t = layout
    ranks = optimizer_state["ranks"]
    assert optimizer_state["layout"] == [p, d, t] and len(ranks) == p * d * t
    hidden = 4 * d_model
    # q, k, v and the ffn's up projection are split by rows (column parallel), the attention's out
    # projection and the ffn's down projection by columns (row parallel); FSDP then takes 1/d of the rows.
    split = [(d_model // t, d_model)] * 3 + [(d_model, d_model // t), (hidden // t, d_model),
                                             (d_model, hidden // t)]
    expected = [(rows // d, columns) for rows, columns in split] * (n_layers // p)
    held = []
    for rank, state in enumerate(ranks):
        # The core puts the matrices that decay first, the stage's blocks' in order (lmlab.api.ParamInfo).
        blocks = state["param_groups"][0]["params"][:len(expected)]
        held.append([state["state"][i]["exp_avg"] for i in blocks])
        assert [tuple(x.shape) for x in held[-1]] == expected, f"rank {rank}"
    for first in range(0, len(ranks), t):  # a tensor group is t adjacent ranks
        for other in range(first + 1, first + t):
            for mine, theirs in zip(held[first], held[other]):
                assert not torch.allclose(mine, theirs), f"ranks {first} and {other} hold the same slice"


@pytest.mark.slow  # a 2-process run, then a resume of it refused once its processes start: one to two minutes
def test_a_3d_run_resumes_only_on_its_own_layout_and_each_tensor_rank_holds_its_slice(manifest, lmlab, refused,
                                                                                       tmp_path):
    import shutil

    tensor = 'use = "3d"\ndevices = 2\naccelerator = "cpu"\ntensor = 2'
    path = manifest(tensor)
    trained = lmlab("run", str(path), "--out", str(tmp_path / "tensor"))
    assert trained.returncode == 0, trained.stderr[-3000:]
    folder = tmp_path / "tensor" / "default"
    ckpt = folder / "checkpoints" / "last.ckpt"
    state = torch.load(ckpt, map_location="cpu", weights_only=True)["optimizer_states"][0]
    assert_blocks_split_over_tensor_ranks(state, (1, 1, 2))

    # The same folder with the manifest's layout changed: refused before any process starts.
    (folder / "summary.json").unlink()  # as a kill during the run leaves the folder
    pipeline = manifest('use = "3d"\ndevices = 2\naccelerator = "cpu"\npipeline = 2')
    line = refused(lmlab("run", str(pipeline), "--out", str(tmp_path / "tensor")), str(folder))
    assert "parallel.pipeline: 1 there, 2 now" in line
    # The checkpoint carried into a folder of the other layout: its per-rank optimizer states cannot
    # be dealt out to these ranks, so the run is refused naming `parallel`, once, and the checkpoint is kept.
    moved = tmp_path / "pipeline" / "default" / "checkpoints"
    moved.mkdir(parents=True)
    shutil.copy(ckpt, moved)
    line = refused(lmlab("run", str(pipeline), "--out", str(tmp_path / "pipeline")), "parallel")
    assert "(1, 1, 2) run and this run is (2, 1, 1)" in line and "[init]" in line
    assert (moved / "last.ckpt").read_bytes() == ckpt.read_bytes()
