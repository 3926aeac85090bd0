"""head-prune: the gradient importance is Michel et al.'s head-gate sensitivity, the heads chosen respect
key/value groups, the pruned model computes what the unpruned one does with those heads silenced (in a
full forward and in cached decoding), the record rebuilds it, and impossible settings are refused."""

import copy
from importlib.metadata import entry_points

import pytest
import torch
import torch.nn.functional as F

from lmlab.api import Calibration, UserError
from lmlab.testing import DEFAULT_SHAPE, reference_model, tiny_model

HEAD_DIM = DEFAULT_SHAPE.head_dim  # 4 heads of 8 features, 2 layers


def head_prune(**options):
    cls = next(iter(entry_points(group="lmlab.compress", name="head-prune"))).load()
    return cls(cls.Options(**options))


def calibration(windows: int = 6, seed: int = 3) -> Calibration:
    tokens = torch.randint(0, DEFAULT_SHAPE.vocab_size, (windows, DEFAULT_SHAPE.block_size + 1),
                           generator=torch.Generator().manual_seed(seed))
    return Calibration(tokens, batch_size=4)


def model(attention: str = "gqa", seed: int = 0, **attention_options):
    m = tiny_model(attention, "mlp", seed=seed, attention_options=attention_options or None).eval()
    with torch.no_grad():  # weights far from the init scale, so heads differ clearly in importance
        for p in m.parameters():
            p.mul_(8.0)
    return m


def compress(m, **options) -> dict:
    plugin = head_prune(**options)
    with torch.no_grad():  # as the core calls it
        return plugin.compress(m, calibration())


def silenced(m, keep: dict[str, list[int]]):
    """The unpruned model with the out_proj input columns of every head not kept set to zero."""
    m = copy.deepcopy(m)
    with torch.no_grad():
        for layer, heads in keep.items():
            out = m.blocks[int(layer)].attn.out_proj
            for h in set(range(out.in_features // HEAD_DIM)) - set(heads):
                out.weight[:, h * HEAD_DIM:(h + 1) * HEAD_DIM] = 0
    return m


def reference_importance(m, calib: Calibration) -> torch.Tensor:
    """(layers, heads) Σ over sequences of |∂L_seq/∂ξ| for a gate ξ scaling each head's out_proj columns,
    computed one sequence at a time with torch.func: independent of the plugin's hooks."""
    names = [f"blocks.{i}.attn.out_proj.weight" for i in range(len(m.blocks))]
    weights = {n: m.get_parameter(n).detach() for n in names}
    totals = torch.zeros(len(names), DEFAULT_SHAPE.n_heads)
    for window in calib.windows:
        xi = torch.ones(len(names), DEFAULT_SHAPE.n_heads, requires_grad=True)
        scaled = {n: w * xi[i].repeat_interleave(HEAD_DIM)[None, :] for i, (n, w) in enumerate(weights.items())}
        logits = torch.func.functional_call(m, scaled, (window[None, :-1],))
        loss = F.cross_entropy(logits[0], window[1:], reduction="sum")
        (grad,) = torch.autograd.grad(loss, xi)
        totals += grad.abs()
    return totals


def test_gradient_importance_is_the_head_gate_sensitivity_normalised_per_layer():
    m = model("mha")
    expected = reference_importance(m, calibration())
    expected = expected / expected.norm(dim=1, keepdim=True)
    record = compress(copy.deepcopy(m), heads=2)
    got = torch.tensor([record["importance"][str(i)] for i in range(len(m.blocks))], dtype=torch.float32)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)
    # the two least important heads of the whole model went
    ranked = sorted((got[i, h].item(), i, h) for i in range(2) for h in range(4))
    gone = {(i, h) for _, i, h in ranked[:2]}
    assert {(int(l), h) for l in range(2) for h in range(4) if h not in record["keep"].get(str(l), range(4))} == gone


def test_the_model_parameters_keep_their_trainability_and_get_no_gradient():
    m = model("mha")
    m.blocks[0].ffn.requires_grad_(False)  # a frozen part stays frozen
    compress(m, heads=1)
    assert all(p.grad is None for p in m.parameters())
    assert not any(p.requires_grad for p in m.blocks[0].ffn.parameters())
    assert all(p.requires_grad for p in m.blocks[1].parameters())


@pytest.mark.parametrize("attention, options, heads, kv_left", [
    ("mha", {}, 3, None),                  # one head is the unit
    ("gqa", {"n_kv_heads": 2}, 2, 1),       # a whole group of 2 query heads and its kv head
    ("mqa", {}, 3, 1),                     # single query heads; the shared kv head stays
])
@pytest.mark.parametrize("importance", ["gradient", "random"])
def test_the_pruned_model_equals_silencing_the_removed_heads_in_forward_and_cached_decoding(
        attention, options, heads, kv_left, importance):
    m = model(attention, **options)
    record = compress(pruned := copy.deepcopy(m), heads=heads, importance=importance)
    expected_model = silenced(m, record["keep"])
    removed = sum(4 - len(k) for k in record["keep"].values())
    assert removed == heads
    for layer, keep in record["keep"].items():
        attn = pruned.blocks[int(layer)].attn
        assert attn.head_groups()[0] == len(keep)
        assert attn.q_proj.weight.shape[0] == len(keep) * HEAD_DIM
        if kv_left is not None:
            assert attn.head_groups()[1] == kv_left
        if attention == "gqa":  # whole groups: heads (0, 1) or (2, 3)
            assert keep in ([0, 1], [2, 3])
    tokens = calibration().windows[:2, :-1]
    with torch.no_grad():
        expected = expected_model(tokens)
        torch.testing.assert_close(pruned(tokens), expected, atol=1e-4, rtol=1e-4)
        cache = pruned.new_cache(2, tokens.shape[1])
        steps = [pruned(tokens[:, :5], cache)] + [pruned(tokens[:, t:t + 1], cache) for t in range(5, tokens.shape[1])]
        torch.testing.assert_close(torch.cat(steps, 1), expected, atol=1e-4, rtol=1e-4)


def test_a_fresh_model_restructured_from_the_record_loads_the_pruned_state_strictly():
    m = model("gqa", n_kv_heads=2)
    record = compress(m, heads=2)
    fresh = tiny_model("gqa", "mlp", seed=9, attention_options={"n_kv_heads": 2}).eval()
    head_prune(heads=2).restructure(fresh, record)
    fresh.load_state_dict(m.state_dict(), strict=True)
    probe = calibration().windows[:2, :-1]
    with torch.no_grad():
        assert torch.equal(fresh(probe), m(probe))
    assert record["summary"] == {"heads_removed": 2, "heads_left": 6, "params": sum(p.numel() for p in m.parameters())}


def test_every_layer_keeps_a_head_when_all_but_one_per_layer_go():
    m = model("mha")
    record = compress(m, heads=6)
    assert sorted(record["keep"]) == ["0", "1"] and all(len(k) == 1 for k in record["keep"].values())


def test_random_importance_follows_its_seed():
    keeps = [compress(model("mha"), heads=3, importance="random", seed=s)["keep"] for s in (0, 0, 1, 2, 3)]
    assert keeps[0] == keeps[1]
    assert any(k != keeps[0] for k in keeps[2:])


@pytest.mark.parametrize("attention, options, heads, says", [
    ("gqa", {"n_kv_heads": 2}, 1, "must be a multiple of 2"),
    ("gqa", {"n_kv_heads": 2}, 6, "the model has 8 heads in 2 layers; at most 4 can go"),
    ("mha", {}, 7, "the model has 8 heads in 2 layers; at most 6 can go"),
    ("mha", {}, 8, "at most 6 can go"),
    ("mqa", {}, 12, "at most 6 can go"),
])
def test_a_count_the_model_cannot_lose_is_refused_before_anything_changes(attention, options, heads, says):
    m = model(attention, **options)
    before = copy.deepcopy(m.state_dict())
    with pytest.raises(UserError, match=says) as caught:
        compress(m, heads=heads)
    assert caught.value.key == "compress.head-prune.heads"
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())


def test_a_position_scheme_with_per_head_biases_is_refused():
    m = tiny_model("mha", "mlp", position="alibi")
    with pytest.raises(UserError) as caught:
        compress(m, heads=1)
    assert caught.value.key == "position.use"


def test_a_mixer_without_heads_is_refused_naming_the_attention_plugin():
    learned = next(iter(entry_points(group="lmlab.position", name="learned"))).load()
    m = reference_model(DEFAULT_SHAPE, learned()).eval()  # the kit's reference attention has no head_groups
    with pytest.raises(UserError, match="no heads") as caught:
        compress(m, heads=1)
    assert caught.value.key == "attention.use"
