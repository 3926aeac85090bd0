"""The tensor-parallel plans of mlp and swiglu (Megatron-LM's split by hidden units), in one process;
the sharded forward pass itself is compared with the unsharded one on two processes in
plugins/lmlab-modelparallel/tests/test_plans.py."""

from importlib.metadata import entry_points

import pytest

from lmlab.api import ModelShape

SHAPE = ModelShape(n_layers=2, d_model=32, n_heads=4, block_size=16, vocab_size=11)


def ffn(name: str, **options):
    cls = next(iter(entry_points(group="lmlab.ffn", name=name))).load()
    return cls(cls.Options(**options)).build(SHAPE, 0)


def test_projections_into_the_hidden_width_split_by_columns_and_the_one_back_by_rows():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    for name, into, back in (("mlp", ["c_fc"], "c_proj"), ("swiglu", ["gate_proj", "up_proj"], "down_proj")):
        plan = ffn(name).tensor_parallel_plan(2)
        assert set(plan) == {*into, back}
        assert all(type(plan[k]) is ColwiseParallel for k in into) and type(plan[back]) is RowwiseParallel


@pytest.mark.parametrize("name", ["mlp", "swiglu"])
def test_a_hidden_width_that_does_not_split_evenly_is_refused(name):
    with pytest.raises(ValueError, match="evenly"):
        ffn(name, hidden=30).tensor_parallel_plan(4)
