"""The tensor-parallel plan of mha / gqa / mqa (Megatron-LM's split by heads), in one process; the
sharded forward pass itself is compared with the unsharded one on two processes in
plugins/lmlab-modelparallel/tests/test_plans.py."""

from importlib.metadata import entry_points

import pytest
import torch

from lmlab.api import ModelShape

SHAPE = ModelShape(n_layers=2, d_model=32, n_heads=4, block_size=16, vocab_size=11)


def attention(name: str, **options):
    cls = next(iter(entry_points(group="lmlab.attention", name=name))).load()
    return cls(cls.Options(**options)).build(SHAPE, 0)


@pytest.mark.parametrize("name, options, tp_size", [("mha", {}, 3), ("gqa", {"n_kv_heads": 2}, 4), ("mqa", {}, 2)])
def test_a_split_that_would_cut_heads_is_refused_with_the_reason(name, options, tp_size):
    with pytest.raises(ValueError, match="whole heads"):
        attention(name, **options).tensor_parallel_plan(tp_size)


def test_asking_for_a_plan_changes_nothing_and_names_every_projection():
    module = attention("gqa", n_kv_heads=2)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    assert set(module.tensor_parallel_plan(2)) == {"q_proj", "k_proj", "v_proj", "out_proj"}
    assert module.tp_size == 1  # the local heads are taken when the plan is applied, not when asked for
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
