import pytest

from lmlab.api import CheckContext, ModelShape, Parallel, UserError
from lmlab.testing import stand_in_run
from lmlab_modelparallel.pipeline import PipelineParallel

pytestmark = pytest.mark.exclusive  # several processes at once


def make(**options) -> PipelineParallel:
    return PipelineParallel(PipelineParallel.Options(**options))


def built(plugin: PipelineParallel, n_layers: int, batch_size: int = 4) -> None:
    """The check lmlab runs before anything is built, for a model of ``n_layers`` blocks."""
    shape = ModelShape(n_layers=n_layers, d_model=8, n_heads=2, block_size=8, vocab_size=16)
    plugin.check(CheckContext(shape=shape, plugins={}, manifest={},
                              run=stand_in_run(train={"batch_size": batch_size, "precision": "32-true"})))


def test_pipeline_is_a_parallel_plugin_that_runs_forward_and_backward_itself():
    assert issubclass(PipelineParallel, Parallel)
    assert PipelineParallel.runs_forward_backward
    for field in PipelineParallel.Options.model_fields.values():
        assert field.description


def test_pipeline_makes_every_process_a_stage_of_one_replica():
    from lightning.pytorch.strategies import ModelParallelStrategy

    kwargs = make(devices=2, accelerator="cpu", schedule="gpipe").trainer_kwargs()
    strategy = kwargs.pop("strategy")
    assert kwargs == {"accelerator": "cpu", "devices": 2, "num_nodes": 1}
    assert isinstance(strategy, ModelParallelStrategy)
    # One data-parallel replica: every stage reads the same batch.
    assert (strategy._data_parallel_size, strategy._tensor_parallel_size) == (1, 2)


def test_stages_split_the_blocks_evenly_earlier_stages_taking_the_extra_ones_or_as_told():
    assert make().bounds(7, 3) == [0, 3, 5, 7]
    assert make().bounds(4, 4) == [0, 1, 2, 3, 4]
    assert make(split=[1, 3]).bounds(4, 2) == [0, 1, 4]


@pytest.mark.parametrize("options, n_layers, key", [
    ({"devices": 3}, 2, "parallel.devices"),                        # more stages than blocks
    ({"devices": 2, "split": [1, 2]}, 2, "parallel.split"),         # does not sum to n_layers
    ({"devices": 2, "split": [2]}, 2, "parallel.split"),            # one entry per stage
    ({"devices": 2, "n_microbatches": 3}, 2, "parallel.n_microbatches"),  # does not divide the batch of 4
    ({"devices": 4, "n_microbatches": 2}, 4, "parallel.n_microbatches"),  # 1f1b: fewer than the stages
])
def test_layouts_the_pipeline_cannot_run_are_refused_naming_the_option(options, n_layers, key):
    with pytest.raises(UserError, match=key):
        built(make(accelerator="cpu", **options), n_layers)


def test_gpipe_takes_fewer_micro_batches_than_stages():
    built(make(accelerator="cpu", devices=4, n_microbatches=2, schedule="gpipe"), 4)


def test_more_stages_than_layers_stop_the_run_before_it_starts(manifest, lmlab, refused):
    path = manifest('use = "pipeline"\ndevices = 3\naccelerator = "cpu"')  # the manifest has 2 blocks
    line = refused(lmlab("run", str(path), "--out", str(path.parent / "out")), "parallel.devices")
    assert "model.n_layers is 2" in line


# GPipe runs the same lmlab code as 1F1B (only torch's order of passes differs) and costs as much
# again (about a minute on two busy cores): slow.
@pytest.mark.parametrize("schedule, extra", [("1f1b", ""),
                                             pytest.param("gpipe", "n_microbatches = 4", marks=pytest.mark.slow)])
def test_a_two_stage_pipeline_trains_exactly_what_one_device_does(tmp_path, schedule, extra):
    from lmlab.testing import check_parallel_matches_single

    # Stage 0: embedding + block 0; stage 1: block 1 + norm + the head, tied to the embedding (its
    # gradient is summed over both stages). Measured: about 2e-7 over 20 steps (float32 rounding of
    # the micro-batch sum); the loss comes from the last stage, broadcast to both.
    check_parallel_matches_single(f'use = "pipeline"\ndevices = 2\naccelerator = "cpu"\nschedule = "{schedule}"\n'
                                  f'{extra}', tmp_path, replicas=1, processes=2, atol=1e-5)


def test_the_memory_layout_is_the_fullest_stage_s(toy_model):
    model = toy_model(4)  # 1000 embedding (tied head) + 4 × 300 in blocks = 2200
    gpipe = make(devices=2, schedule="gpipe", n_microbatches=4).memory_layout(model, None, "32-true")
    # Each stage: 2 blocks and the embedding (the first embeds, the last scores with it).
    assert gpipe.devices == 2 and gpipe.data_parallel == 1
    assert gpipe.params == pytest.approx((600 + 1000) / 2200)
    assert gpipe.activations == pytest.approx(0.5)  # half the layers, every micro-batch at once
    one_f_one_b = make(devices=2, n_microbatches=4).memory_layout(model, None, "32-true")
    assert one_f_one_b.activations == pytest.approx(0.5 * 2 / 4)  # at most 2 micro-batches in flight
    untied = make(devices=2, split=[3, 1]).memory_layout(toy_model(4, tied=False), None, "32-true")
    assert untied.params == pytest.approx((900 + 1000) / 3200)
