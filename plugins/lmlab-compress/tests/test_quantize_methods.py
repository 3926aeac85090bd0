"""The quantisation plugins as the core drives them: compress a model in place, save its state dict,
restructure a fresh model from the record, load strictly, and compute the same outputs."""

import json

import pydantic
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lmlab.api import Calibration, Compressor, UserError
from lmlab_compress.awq import AWQ, Int4
from lmlab_compress.grouped import GroupQuantLinear, RoundToNearest
from lmlab_compress.int8 import Int8, Int8Linear
from lmlab_compress.nf4 import NF4, NF4Linear

WIDTH, HIDDEN, VOCAB = 64, 128, 48


class ToyLM(nn.Module):
    """A one-block language model shaped like lmlab's: q/k/v read one normalised input, a gated FFN's
    gate and up read another, the head is tied to the embedding."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.tok_emb = nn.Embedding(VOCAB, WIDTH)
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.q_proj, self.k_proj = nn.Linear(WIDTH, WIDTH, bias=False), nn.Linear(WIDTH, WIDTH, bias=False)
        self.v_proj, self.out_proj = nn.Linear(WIDTH, WIDTH, bias=False), nn.Linear(WIDTH, WIDTH)
        self.ffn = nn.ModuleDict(dict(gate=nn.Linear(WIDTH, HIDDEN, bias=False), up=nn.Linear(WIDTH, HIDDEN),
                                      down=nn.Linear(HIDDEN, WIDTH)))
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.tok_emb.weight
        with torch.no_grad():  # a few large channels, as trained models have
            self.norm1.weight[:3] = 8.0

    def forward(self, idx):
        x = self.tok_emb(idx)
        h = self.norm1(x)
        q, k, v = self.q_proj(h), self.k_proj(h), self.v_proj(h)
        x = x + self.out_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        h = self.norm2(x)
        x = x + self.ffn["down"](F.silu(self.ffn["gate"](h)) * self.ffn["up"](h))
        return self.head(x)


LINEARS = ["q_proj", "k_proj", "v_proj", "out_proj", "ffn.gate", "ffn.up", "ffn.down"]

METHODS = [
    (RoundToNearest, {}), (RoundToNearest, {"bits": 3, "group_size": 64}),
    (RoundToNearest, {"asymmetric": False}), (AWQ, {}), (AWQ, {"bits": 3, "grid": 5}),
    (Int4, {}), (Int4, {"method": "rtn", "group_size": 64}), (Int8, {}), (NF4, {}), (NF4, {"blocksize": 128}),
]


def method(cls, options=None) -> Compressor:
    return cls(cls.Options(**(options or {})))


@pytest.fixture(scope="module")
def calibration():
    return Calibration(torch.randint(0, VOCAB, (8, 17), generator=torch.Generator().manual_seed(1)), batch_size=4)


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, VOCAB, (3, 16), generator=torch.Generator().manual_seed(2))


def state_bytes(state: dict, prefixes) -> int:
    return sum(t.numel() * t.element_size() for k, t in state.items() if k.startswith(tuple(p + "." for p in prefixes)))


@pytest.mark.parametrize("cls, options", METHODS, ids=lambda v: getattr(v, "__name__", None) or json.dumps(v))
@torch.no_grad()
def test_compressed_state_dict_loads_into_a_restructured_fresh_model(cls, options, calibration, tokens, tmp_path):
    model = ToyLM(seed=0).eval()
    float_logits = model(tokens)
    float_bytes = state_bytes(model.state_dict(), LINEARS)
    record = method(cls, options).compress(model, calibration)
    logits = model(tokens)
    assert json.loads(json.dumps(record)) == record  # plain JSON
    assert record["modules"] == LINEARS  # every linear but the tied head, in model order
    assert type(model.head) is nn.Linear and model.head.weight is model.tok_emb.weight
    assert 0 < (logits - float_logits).abs().max() < 0.5 * float_logits.abs().max()

    torch.save(model.state_dict(), tmp_path / "compressed.pt")
    for t in model.state_dict().values():  # plain tensors of plain dtypes: weights_only loading takes them
        assert type(t) is torch.Tensor and t.dtype in (torch.float32, torch.float16, torch.int8, torch.uint8)
    fresh = ToyLM(seed=1).eval()
    method(cls, options).restructure(fresh, json.loads(json.dumps(record)))
    fresh.load_state_dict(torch.load(tmp_path / "compressed.pt", weights_only=True), strict=True)
    assert torch.equal(fresh(tokens), logits)
    quantised_bytes = state_bytes(fresh.state_dict(), LINEARS)
    assert quantised_bytes / float_bytes == pytest.approx(record["summary"]["linear_bytes_ratio"], rel=1e-6)


@pytest.mark.parametrize("cls, options, most", [
    (RoundToNearest, {}, 0.16), (RoundToNearest, {"bits": 3}, 0.13), (Int4, {}, 0.17),  # + AWQ's 1/s per input
    (NF4, {}, 0.15), (Int8, {}, 0.27)])
def test_linear_bytes_drop_as_the_bits_say(cls, options, most, calibration):
    """Weights (out, in) of 32 bits become: int4 g32 4 + (16 + 8) / 32 bits (0.148), int3 3.75 (0.117),
    NF4 4 + 32 / 64 (0.141), int8 8 (0.25); plus each layer's float bias (and AWQ's input scale)."""
    model = ToyLM(seed=0)
    before = state_bytes(model.state_dict(), LINEARS)
    method(cls, options).compress(model, calibration)
    assert state_bytes(model.state_dict(), LINEARS) / before <= most


def test_each_method_leaves_its_module_type(calibration):
    expected = {RoundToNearest: GroupQuantLinear, AWQ: GroupQuantLinear, Int4: GroupQuantLinear,
                Int8: Int8Linear, NF4: NF4Linear}
    for cls, module_type in expected.items():
        model = ToyLM(seed=0)
        method(cls).compress(model, calibration)
        assert all(type(model.get_submodule(n)) is module_type for n in LINEARS), cls


def test_awq_shares_one_scale_among_layers_reading_the_same_input(calibration):
    model = ToyLM(seed=0)
    record = method(AWQ).compress(model, calibration)
    assert sorted(map(sorted, (g["layers"] for g in record["scales"].values()))) == sorted(
        [["k_proj", "q_proj", "v_proj"], ["out_proj"], ["ffn.gate", "ffn.up"], ["ffn.down"]])
    assert torch.equal(model.q_proj.input_scale, model.v_proj.input_scale)
    assert not torch.equal(model.q_proj.input_scale, model.ffn.gate.input_scale)
    # the salient channels (norm1's large weights) are scaled up: 1/s is smallest there
    assert record["scales"]["q_proj"]["alpha"] > 0
    assert model.q_proj.input_scale[:3].max() < model.q_proj.input_scale[3:].min()


def calibration_loss(model, calibration) -> float:
    with torch.no_grad():
        return sum(float(F.cross_entropy(model(i).flatten(0, 1), t.flatten(), reduction="sum"))
                   for i, t in calibration.batches()) / calibration.tokens


@pytest.mark.parametrize("search", ["loss", "output"])
def test_awq_loses_less_than_round_to_nearest_on_the_calibration_data(search, calibration):
    losses = {}
    for m in (method(RoundToNearest, {"bits": 3}), method(AWQ, {"bits": 3, "search": search})):
        model = ToyLM(seed=0).eval()
        m.compress(model, calibration)
        losses[m.method_name] = calibration_loss(model, calibration)
    float_loss = calibration_loss(ToyLM(seed=0).eval(), calibration)
    assert losses["awq"] - float_loss < 0.8 * (losses["rtn"] - float_loss), (float_loss, losses)


def test_awq_loss_search_keeps_a_tied_embedding_float(calibration):
    model = ToyLM(seed=0)
    embedding = model.tok_emb.weight.detach().clone()
    record = method(AWQ, {"skip": []}).compress(model, calibration)
    assert "head" in record["modules"] and type(model.head) is GroupQuantLinear
    assert torch.equal(model.tok_emb.weight, embedding) and model.tok_emb.weight.requires_grad


class Features(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.proj = nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, 8)

    def forward(self, idx):
        return self.proj(self.emb(idx)).mean(1)  # (B, 8): no next-token logits


def test_awq_loss_search_refuses_a_model_without_logits_and_output_search_takes_it(calibration):
    with pytest.raises(UserError) as err:
        method(AWQ).compress(Features(), calibration)
    assert err.value.key == "compress.awq.search"
    model = Features()
    assert method(AWQ, {"search": "output"}).compress(model, calibration)["modules"] == ["proj"]
    assert type(model.proj) is GroupQuantLinear


def test_a_later_method_touches_only_the_linears_left(calibration, tokens, tmp_path):
    model = ToyLM(seed=0).eval()
    awq = method(AWQ, {"skip": ["head", "ffn"]})
    int8 = method(Int8)
    records = [awq.compress(model, calibration), int8.compress(model, None)]
    assert records[1]["modules"] == ["ffn.gate", "ffn.up", "ffn.down"]
    assert type(model.q_proj) is GroupQuantLinear and type(model.ffn.up) is Int8Linear
    torch.save(model.state_dict(), tmp_path / "chain.pt")
    fresh = ToyLM(seed=3).eval()
    for m, r in zip((awq, int8), records):
        m.restructure(fresh, r)
    fresh.load_state_dict(torch.load(tmp_path / "chain.pt", weights_only=True), strict=True)
    with torch.no_grad():
        assert torch.equal(fresh(tokens), model(tokens))


def test_skipping_the_head_can_be_undone():
    model = ToyLM(seed=0)
    record = method(RoundToNearest, {"skip": []}).compress(model, None)
    assert record["modules"][-1] == "head" and type(model.tok_emb) is nn.Embedding


def test_bad_settings_name_their_option(calibration):
    with pytest.raises(UserError) as err:
        method(RoundToNearest, {"group_size": 48}).compress(ToyLM(seed=0), None)
    assert err.value.key == "compress.rtn.group_size" and "q_proj" in str(err.value)
    with pytest.raises(UserError) as err:
        method(Int4, {"group_size": 96}).compress(ToyLM(seed=0), calibration)
    assert err.value.key == "compress.int4.group_size"
    with pytest.raises(UserError) as err:
        method(NF4, {"skip": ["head", "blocks.0.mlp"]}).compress(ToyLM(seed=0), None)
    assert err.value.key == "compress.nf4.skip" and "blocks.0.mlp" in str(err.value)
    with pytest.raises(UserError) as err:
        method(AWQ).compress(ToyLM(seed=0), None)
    assert err.value.key == "compress.awq"
    for cls, options in [(RoundToNearest, {"bits": 5}), (AWQ, {"grid": 1}), (Int4, {"method": "gptq"}),
                         (NF4, {"blocksize": 48}), (RoundToNearest, {"group_size": 0})]:
        with pytest.raises(pydantic.ValidationError):  # the core reports these as compress.NAME.OPTION
            cls.Options(**options)


def test_a_refused_setting_changes_nothing():
    model = ToyLM(seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UserError):
        method(RoundToNearest, {"group_size": 128}).compress(model, None)  # divides ffn.down's 128 only
    assert all(type(model.get_submodule(n)) is nn.Linear for n in LINEARS)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_only_awq_needs_calibration():
    assert AWQ.calibrated and not RoundToNearest.calibrated and not Int8.calibrated and not NF4.calibrated
    assert method(Int4).calibrated and not method(Int4, {"method": "rtn"}).calibrated
