"""causal-lm, mlm and sft pass lmlab's conformance kit for the objective slot, at their defaults and at
options that change what a batch holds (span masking, packing) or what the loss adds (z-loss)."""

import pytest

from lmlab.testing.objective import check_objective
from lmlab_objectives.causal_lm import CausalLM
from lmlab_objectives.mlm import MLM
from lmlab_objectives.sft import SFT

CASES = [
    (CausalLM, None, {}),
    # The z-loss adds z · log(Z)² to the cross-entropy: the loss is no longer the plain cross-entropy.
    (CausalLM, {"z_loss": 1e-4}, {"cross_entropy": False}),
    (MLM, None, {}),
    (MLM, {"span_mean": 3, "span_max": 6, "mask_fraction": 0.5, "random_fraction": 0.3, "mask_rate": 0.3}, {}),
    (SFT, None, {}),
    (SFT, {"packing": True}, {}),
]


@pytest.mark.parametrize("plugin, options, settings", CASES, ids=[f"{p.__name__}-{o}" for p, o, _ in CASES])
def test_objective_conforms(plugin, options, settings):
    check_objective(plugin, options, **settings)


def test_mlm_with_a_code_mask_rate_conforms_on_a_corpus_without_code():
    check_objective(MLM, {"code_mask_rate": 0.5})
