"""LanguageModel.pipeline_stage (API 1.3): stages run one after another compute the whole model,
keep the whole model's parameter names, and together hold its whole state dict."""

import copy

import pytest
import torch

from lmlab import discovery
from lmlab.api import ModelShape
from lmlab.model import LanguageModel

SHAPE = ModelShape(n_layers=4, d_model=32, n_heads=4, block_size=16, vocab_size=37)


def whole(tie: bool = True, position: str = "learned") -> LanguageModel:
    torch.manual_seed(0)
    plugins = {slot: discovery.load(slot, name)() for slot, name in
               (("attention", "mha"), ("position", position), ("ffn", "mlp"))}
    return LanguageModel(SHAPE, tie_embeddings=tie, **plugins).eval()


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("bounds", [[0, 2, 4], [0, 1, 3, 4], [0, 3, 4]])
def test_stages_run_in_turn_compute_the_whole_model_and_hold_its_state_dict(tie, bounds):
    model = whole(tie)
    stages = [copy.deepcopy(model) for _ in bounds[:-1]]
    for stage, start, stop in zip(stages, bounds, bounds[1:]):
        stage.pipeline_stage(start, stop)
    idx = torch.randint(0, SHAPE.vocab_size, (2, 12))
    with torch.no_grad():
        x = idx
        for stage in stages[:-1]:
            x = stage(x)
            assert x.shape == (2, 12, SHAPE.d_model)  # hidden states travel between stages
        torch.testing.assert_close(stages[-1](x), model(idx), rtol=0, atol=0)
    combined = {}
    for stage in stages:
        combined.update(stage.state_dict())
    expected = model.state_dict()
    assert set(combined) == set(expected)
    assert all(torch.equal(combined[k], v) for k, v in expected.items())
    # The first stage embeds, the last scores: the tied head keeps its weight (the embedding's) there.
    assert "tok_emb.weight" in stages[0].state_dict() and "head.weight" in stages[-1].state_dict()
    assert ("tok_emb.weight" in stages[-1].state_dict()) == tie
    assert "head.weight" not in stages[0].state_dict()


def test_a_stage_holds_only_its_own_blocks():
    model = whole()
    model.pipeline_stage(1, 3)
    names = {name.split(".")[1] for name, _ in model.named_parameters() if name.startswith("blocks.")}
    assert names == {"1", "2"}
    assert model.tok_emb is None and model.head is None and model.norm_f is None


@pytest.mark.parametrize("start, stop", [(0, 0), (2, 1), (0, 5), (-1, 2)])
def test_an_empty_or_out_of_range_span_is_refused(start, stop):
    with pytest.raises(ValueError, match="span"):
        whole().pipeline_stage(start, stop)


def test_a_stage_cannot_decode():
    model = whole()
    model.pipeline_stage(0, 2)
    with pytest.raises(ValueError, match="cannot decode"):
        model.new_cache(1, 8)
