"""The tensor-parallel plan of mha / gqa / mqa (Megatron-LM's split by heads), in one process; the
sharded forward pass itself is compared with the unsharded one on two processes in
plugins/lmlab-modelparallel/tests/test_plans.py."""

from importlib.metadata import entry_points

import pytest
import torch

from lmlab.api import ModelShape
from lmlab_attention.tensor_parallel import rank_major_rows

SHAPE = ModelShape(n_layers=2, d_model=32, n_heads=4, block_size=16, vocab_size=11)


def attention(name: str, **options):
    cls = next(iter(entry_points(group="lmlab.attention", name=name))).load()
    return cls(cls.Options(**options)).build(SHAPE, 0)


def test_the_fused_projection_gives_each_rank_its_share_of_queries_keys_and_values():
    # q: 4 rows, k and v: 2 rows each, over 2 ranks: rank 0 takes q0 q1 k0 v0, rank 1 q2 q3 k1 v1.
    assert rank_major_rows([4, 2, 2], 2).tolist() == [0, 1, 4, 6, 2, 3, 5, 7]
    assert sorted(rank_major_rows([8, 4, 4], 4).tolist()) == list(range(16))
    assert rank_major_rows([8, 4, 4], 1).tolist() == list(range(16))


@pytest.mark.parametrize("name, options, tp_size", [("mha", {}, 3), ("gqa", {"n_kv_heads": 2}, 4), ("mqa", {}, 2)])
def test_a_split_that_would_cut_heads_is_refused_with_the_reason(name, options, tp_size):
    with pytest.raises(ValueError, match="whole heads"):
        attention(name, **options).tensor_parallel_plan(tp_size)


def test_asking_for_a_plan_changes_nothing_and_names_both_projections():
    module = attention("gqa", n_kv_heads=2)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    assert set(module.tensor_parallel_plan(2)) == {"qkv_proj", "out_proj"}
    assert module.tp_size == 1  # the local heads are taken when the plan is applied, not when asked for
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
