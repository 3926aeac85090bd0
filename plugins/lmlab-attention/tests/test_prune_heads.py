"""Head pruning of mha / gqa / mqa (API 1.9): a pruned module computes exactly what the unpruned one does
with the removed heads' outputs zeroed before the output projection, in a full forward and in cached
decoding, and it passes the conformance kit as a module of its own."""

import copy
import dataclasses
from importlib.metadata import entry_points

import pytest
import torch

from lmlab.api import MixerContext, ModelShape, PositionModule, UserError
from lmlab.testing import check_attention
from lmlab.testing.reference import ReferencePositionModule

SHAPE = ModelShape(n_layers=2, d_model=32, n_heads=4, block_size=16, vocab_size=11)
HEAD_DIM = SHAPE.head_dim

# (plugin, options, query heads kept): one head of MHA; a whole key/value group of GQA (heads 0, 1 read
# kv head 0); two query heads of MQA, whose one key/value head stays.
CASES = [("mha", {}, [0, 2, 3]), ("gqa", {"n_kv_heads": 2}, [2, 3]), ("mqa", {}, [1, 3])]


def plugin_class(name: str):
    return next(iter(entry_points(group="lmlab.attention", name=name))).load()


def build(name: str, options: dict, bias: bool = False):
    cls = plugin_class(name)
    torch.manual_seed(0)
    shape = dataclasses.replace(SHAPE, bias=bias)
    module = cls(cls.Options(**options)).build(shape, 0)
    with torch.no_grad():  # far from the init scale, so a head read at the wrong place shows
        for p in module.parameters():
            p.normal_(0.0, 0.3)
    return module.eval()


def zeroed(module, keep: list[int]):
    """The unpruned module with the out_proj input columns of every head not in ``keep`` set to zero."""
    reference = copy.deepcopy(module)
    with torch.no_grad():
        for h in set(range(module.n_heads)) - set(keep):
            reference.out_proj.weight[:, h * HEAD_DIM:(h + 1) * HEAD_DIM] = 0
    return reference


def context(position, start: int, end: int) -> MixerContext:
    return MixerContext(position=position, positions=torch.arange(start, end), start=start)


POSITIONS = {"none": PositionModule(), "rotating and biasing": ReferencePositionModule(SHAPE)}


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("position", list(POSITIONS))
@pytest.mark.parametrize("name, options, keep", CASES, ids=[c[0] for c in CASES])
def test_pruning_heads_equals_zeroing_their_outputs_in_forward_and_cached_decoding(name, options, keep, position,
                                                                                    bias):
    module = build(name, options, bias)
    expected_module = zeroed(module, keep)
    kv_before = module.n_kv_heads
    module.prune_heads(keep)
    pos = POSITIONS[position]
    x = torch.randn(2, 12, SHAPE.d_model, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = expected_module(x, context(pos, 0, 12))
        torch.testing.assert_close(module(x, context(pos, 0, 12)), expected, atol=1e-5, rtol=1e-5)
        state = module.new_state(2, 12, x.device, x.dtype)
        for start, end in [(0, 5), (5, 6), (6, 7), (7, 12)]:  # prefill, two steps, a chunk
            y = module(x[:, start:end], context(pos, start, end), state)
            torch.testing.assert_close(y, expected[:, start:end], atol=1e-5, rtol=1e-5)
    # the projections really shrank, and the cache with them
    assert module.n_heads == len(keep)
    assert module.q_proj.weight.shape == (len(keep) * HEAD_DIM, SHAPE.d_model)
    assert module.out_proj.weight.shape == (SHAPE.d_model, len(keep) * HEAD_DIM)
    kv_kept = {"mha": 3, "gqa": 1, "mqa": 1}[name]
    assert module.n_kv_heads == kv_kept and kv_before >= kv_kept
    assert module.k_proj.weight.shape[0] == module.v_proj.weight.shape[0] == kv_kept * HEAD_DIM
    assert module.kv_layout() == (kv_kept, HEAD_DIM)


def test_pruning_twice_keeps_reading_the_bias_of_the_original_heads():
    module = build("mha", {})
    expected = zeroed(module, [1, 3])
    module.prune_heads([0, 1, 3])
    module.prune_heads([1, 2])  # of the remaining [0, 1, 3]: originals 1 and 3
    pos = POSITIONS["rotating and biasing"]
    x = torch.randn(2, 8, SHAPE.d_model, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(module(x, context(pos, 0, 8)), expected(x, context(pos, 0, 8)), atol=1e-5,
                                   rtol=1e-5)
    assert module.kept_heads.tolist() == [1, 3]


@pytest.mark.parametrize("name, options, keep", CASES, ids=[c[0] for c in CASES])
def test_a_pruned_module_passes_the_conformance_kit(name, options, keep):
    base = plugin_class(name)

    class Pruned(base):  # builds the plugin's module, then prunes it: the kit checks it like any module
        def build(self, shape, layer):
            module = super().build(shape, layer)
            module.prune_heads(keep)
            return module

    Pruned.name = f"{name} pruned to heads {keep}"
    # compile: minutes of tracing on a 2-core machine and nothing pruning-specific (the shapes are static)
    check_attention(Pruned, options, skip=["compile"])


def test_the_state_dict_of_a_pruned_module_loads_strictly_into_a_fresh_module_pruned_alike():
    module = build("gqa", {"n_kv_heads": 2}, bias=True)
    module.prune_heads([0, 1])
    fresh = build("gqa", {"n_kv_heads": 2}, bias=True)
    fresh.prune_heads([0, 1])
    fresh.load_state_dict(module.state_dict(), strict=True)
    x = torch.randn(1, 6, SHAPE.d_model)
    with torch.no_grad():
        assert torch.equal(fresh(x, context(PositionModule(), 0, 6)), module(x, context(PositionModule(), 0, 6)))
    assert "kept_heads" not in module.state_dict()  # the loader recreates it from the pruning record


def test_head_groups_reports_query_and_key_value_heads():
    assert build("mha", {}).head_groups() == (4, 4)
    assert build("gqa", {"n_kv_heads": 2}).head_groups() == (4, 2)
    assert build("mqa", {}).head_groups() == (4, 1)


@pytest.mark.parametrize("keep, why", [([], "distinct"), ([2, 1], "ascending"), ([1, 1], "distinct"),
                                       ([0, 4], "distinct"), ([0, 1, 2], "different sizes"),
                                       ([1, 2, 3], "different sizes")])
def test_a_keep_list_that_breaks_the_grouping_is_refused_before_anything_changes(keep, why):
    module = build("gqa", {"n_kv_heads": 2})
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(ValueError, match=why):
        module.prune_heads(keep)
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())


def test_a_tensor_parallel_module_refuses_to_report_or_prune_heads():
    module = build("mha", {})
    module.tp_size = 2  # as the plan's on_apply leaves it
    with pytest.raises(UserError, match="tensor-parallel"):
        module.head_groups()
    with pytest.raises(UserError, match="tensor-parallel"):
        module.prune_heads([0, 1])


def test_pruning_draws_nothing_from_the_global_random_generator():
    module = build("gqa", {"n_kv_heads": 2})
    state = torch.get_rng_state()
    module.prune_heads([0, 1])  # a pruned run's loader does this between seeding and sampling
    assert torch.equal(torch.get_rng_state(), state)
