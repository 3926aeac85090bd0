"""wanda and magnitude: which weights go (the lowest scores, per row for wanda, per layer for magnitude,
per group of M for N:M), the sparsity reached, what is left dense, the record, and the refusals."""

import copy
from importlib.metadata import entry_points

import pytest
import torch
from torch import nn

from lmlab.api import Calibration, UserError
from lmlab.testing import DEFAULT_SHAPE, tiny_model
from lmlab.testing.runs import main as lmlab


def method(name: str, **options):
    cls = next(iter(entry_points(group="lmlab.compress", name=name))).load()
    return cls(cls.Options(**options))


def calibration(windows: int = 6, seed: int = 3) -> Calibration:
    tokens = torch.randint(0, DEFAULT_SHAPE.vocab_size, (windows, DEFAULT_SHAPE.block_size + 1),
                           generator=torch.Generator().manual_seed(seed))
    return Calibration(tokens, batch_size=4)


def model():
    return tiny_model("gqa", "mlp", seed=0).eval()


def linears(m) -> dict[str, nn.Linear]:
    return {f"blocks.{n}": x for n, x in m.blocks.named_modules() if isinstance(x, nn.Linear)}


def measured_input_norms(m, calib: Calibration) -> dict[str, torch.Tensor]:
    """‖X_j‖₂ of every block linear's inputs, gathered here independently of the plugin."""
    inputs = {name: [] for name in linears(m)}
    handles = [layer.register_forward_hook(lambda mod, args, out, name=name: inputs[name].append(args[0].flatten(0, 1)))
               for name, layer in linears(m).items()]
    with torch.no_grad():
        for x, _ in calib.batches():
            m(x)
    for h in handles:
        h.remove()
    return {name: torch.cat(xs).norm(dim=0) for name, xs in inputs.items()}


def compress(name: str, m=None, **options):
    m = m if m is not None else model()
    plugin = method(name, **options)
    with torch.no_grad():  # as the core calls it
        record = plugin.compress(m, calibration() if plugin.calibrated else None)
    return m, record


def score_of(name: str, dense, norms) -> dict[str, torch.Tensor]:
    """Each block linear's (out, in) score as the paper defines it, from the dense model's weights."""
    return {n: x.weight.abs() * (norms[n] if name == "wanda" else 1) for n, x in linears(dense).items()}


@pytest.mark.parametrize("name, compare", [("wanda", None), ("magnitude", "row")])
def test_row_wise_pruning_zeroes_the_lowest_scores_of_every_output_row(name, compare):
    dense = model()
    scores = score_of(name, dense, measured_input_norms(dense, calibration()))
    options = {"compare": compare} if compare else {}  # wanda compares per row by default
    pruned, record = compress(name, copy.deepcopy(dense), sparsity=0.5, **options)
    for layer_name, layer in linears(pruned).items():
        score, kept = scores[layer_name], layer.weight != 0
        assert (~kept).sum(1).eq(round(0.5 * layer.in_features)).all(), layer_name  # every row at 50%
        lowest_kept = score.masked_fill(~kept, float("inf")).amin(1)
        highest_dropped = score.masked_fill(kept, float("-inf")).amax(1)
        assert (lowest_kept >= highest_dropped).all(), layer_name
        original = linears(dense)[layer_name].weight
        assert torch.equal(layer.weight[kept], original[kept])  # survivors untouched
    assert record["sparsity"] == pytest.approx(0.5)


@pytest.mark.parametrize("name, compare", [("magnitude", None), ("wanda", "layer")])
def test_layer_wise_pruning_zeroes_the_lowest_scores_of_each_whole_layer(name, compare):
    dense = model()
    scores = score_of(name, dense, measured_input_norms(dense, calibration()))
    options = {"compare": compare} if compare else {}  # magnitude compares over the layer by default
    pruned, record = compress(name, copy.deepcopy(dense), sparsity=0.3, **options)
    uneven = False
    for layer_name, layer in linears(pruned).items():
        score, kept = scores[layer_name], layer.weight != 0
        assert int((~kept).sum()) == round(0.3 * layer.weight.numel()), layer_name
        assert score[kept].min() >= score[~kept].max(), layer_name
        uneven |= len(set((~kept).sum(1).tolist())) > 1
    assert uneven  # compared over the layer, not per row: rows lose different numbers
    assert record["sparsity"] == pytest.approx(0.3, abs=1e-3)


@pytest.mark.parametrize("name", ["wanda", "magnitude"])
@pytest.mark.parametrize("pattern, n, m", [("2:4", 2, 4), ("1:4", 1, 4), ("4:8", 4, 8)])
def test_n_of_m_keeps_exactly_n_of_every_m_consecutive_weights_with_the_highest_scores(name, pattern, n, m):
    dense = model()
    norms = measured_input_norms(dense, calibration())
    pruned, record = compress(name, copy.deepcopy(dense), pattern=pattern)
    for layer_name, layer in linears(pruned).items():
        original = linears(dense)[layer_name].weight
        score = original.abs() * (norms[layer_name] if name == "wanda" else 1)
        groups = (layer.weight != 0).view(layer.out_features, -1, m)
        assert groups.sum(-1).eq(n).all(), layer_name
        score = score.view(layer.out_features, -1, m)
        lowest_kept = score.masked_fill(~groups, float("inf")).amin(-1)
        highest_dropped = score.masked_fill(groups, float("-inf")).amax(-1)
        assert (lowest_kept >= highest_dropped).all(), layer_name
    assert record["sparsity"] == pytest.approx(1 - n / m)


class ScaledFeatures(nn.Module):
    """One block holding one linear layer of 4 inputs, fed feature j at scale 10, 1, 1, 0.1 (token ids
    pick the signs), so activation norms differ by feature while weights say the opposite."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Module()])
        self.blocks[0].fc = nn.Linear(4, 2, bias=False)
        with torch.no_grad():
            self.blocks[0].fc.weight.copy_(torch.tensor([[1.0, 2.0, 3.0, 4.0], [1.5, 2.5, 3.5, 4.5]]))
        self.register_buffer("scale", torch.tensor([10.0, 1.0, 1.0, 0.1]))

    def forward(self, idx):
        signs = (idx[..., None] % 2) * 2 - 1.0                        # (B, T, 1) of ±1
        return self.blocks[0].fc(signs * self.scale)


def test_wanda_keeps_small_weights_on_loud_features_where_magnitude_drops_them():
    toy_calibration = Calibration(torch.arange(18).view(2, 9))
    with torch.no_grad():
        wanda_model, magnitude_model = ScaledFeatures(), ScaledFeatures()
        method("wanda", sparsity=0.5).compress(wanda_model, toy_calibration)
        method("magnitude", sparsity=0.5).compress(magnitude_model, None)
    # |W|·‖X‖ ∝ (10, 2, 3, 0.4) and (15, 2.5, 3.5, 0.45): features 1 and 3 go; by |W| alone 0 and 1 go
    assert (wanda_model.blocks[0].fc.weight != 0).tolist() == [[True, False, True, False]] * 2
    assert (magnitude_model.blocks[0].fc.weight != 0).tolist() == [[False, False, True, True]] * 2


@pytest.mark.parametrize("name", ["wanda", "magnitude"])
def test_embedding_head_norms_and_biases_stay_dense_and_the_record_counts_what_is_left(name):
    dense = model()
    pruned, record = compress(name, copy.deepcopy(dense), sparsity=0.5)
    assert torch.equal(pruned.tok_emb.weight, dense.tok_emb.weight)  # the tied head with it
    pruned_keys = {f"{n}.weight" for n in linears(pruned)}
    for key, value in pruned.state_dict().items():
        if key not in pruned_keys:
            assert torch.equal(value, dense.state_dict()[key]), key
    assert [layer["name"] for layer in record["layers"]] == list(linears(pruned))
    assert all(layer["sparsity"] == pytest.approx(0.5) for layer in record["layers"])
    nonzero = sum(int(p.count_nonzero()) for p in pruned.parameters())
    assert record["summary"]["nonzero_params"] == nonzero
    assert record["summary"]["sparsity"] == record["sparsity"]
    assert record["summary"]["pruned_params"] == sum(x.weight.numel() for x in linears(pruned).values())


@pytest.mark.parametrize("name", ["wanda", "magnitude"])
def test_a_fresh_model_restructured_from_the_record_loads_the_pruned_state_strictly(name):
    pruned, record = compress(name, pattern="2:4")
    fresh = tiny_model("gqa", "mlp", seed=5).eval()
    method(name, pattern="2:4").restructure(fresh, record)
    fresh.load_state_dict(pruned.state_dict(), strict=True)
    probe = calibration().windows[:2, :-1]
    with torch.no_grad():
        assert torch.equal(fresh(probe), pruned(probe))


@pytest.mark.parametrize("name", ["wanda", "magnitude"])
@pytest.mark.parametrize("setting, says", [("pattern=4:4", "1 <= N < M"), ("pattern=0:4", "1 <= N < M"),
                                           ("pattern=2-4", "must read N:M"), ("sparsity=1.0", "less than 1")])
def test_a_bad_setting_is_refused_on_one_line_naming_the_option(name, setting, says, tmp_path, capsys):
    (tmp_path / "manifest.toml").write_text("")  # methods are resolved before the run is read
    assert lmlab(["compress", str(tmp_path), "--use", name, "--set", setting]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"compress.{name}.{setting.split('=')[0]}:" in err and says in err


def test_a_group_that_does_not_divide_a_layer_is_refused_before_anything_changes():
    dense = model()
    m = copy.deepcopy(dense)
    with pytest.raises(UserError, match="must divide every pruned layer's input width") as caught:
        compress("wanda", m, pattern="2:5")
    assert caught.value.key == "compress.wanda.pattern"
    assert all(torch.equal(v, dense.state_dict()[k]) for k, v in m.state_dict().items())
