"""Every objective passes lmlab's conformance kit for the objective slot, at its defaults and at options
that change what a batch holds (span masking, packing) or what the loss is (z-loss, DPO's variants).
The pair objectives read the kit's preference corpus; those with other runs are given a frozen model
with the heads of the objective each run trained (PPO's reward run: reward-model; a teacher: causal-lm)."""

import pytest

from lmlab.testing.objective import check_objective
from lmlab_objectives.causal_lm import CausalLM
from lmlab_objectives.distill import Distill
from lmlab_objectives.dpo import DPO
from lmlab_objectives.mlm import MLM
from lmlab_objectives.ppo import PPO
from lmlab_objectives.reward_model import RewardModel
from lmlab_objectives.sft import SFT

PAIRS = {"corpus": "preferences"}
TEACHER = {"runs": {"teacher": "causal-lm"}}

CASES = [
    (CausalLM, None, {}),
    # The z-loss adds z · log(Z)² to the cross-entropy: the loss is no longer the plain cross-entropy.
    (CausalLM, {"z_loss": 1e-4}, {"cross_entropy": False}),
    (MLM, None, {}),
    (MLM, {"span_mean": 3, "span_max": 6, "mask_fraction": 0.5, "random_fraction": 0.3, "mask_rate": 0.3}, {}),
    (SFT, None, {}),
    (SFT, {"packing": True}, {}),
    (RewardModel, None, PAIRS),
    (RewardModel, {"margin_l2": 0.01}, PAIRS),
    (DPO, None, PAIRS),
    (DPO, {"loss_type": "ipo", "beta": 0.5}, PAIRS),
    (DPO, {"loss_type": "hinge"}, PAIRS),
    (DPO, {"label_smoothing": 0.1}, PAIRS),
    # Rows leave room for max_new_tokens after the prompt (PPO.check refuses one as long as the block).
    (PPO, {"max_new_tokens": 4}, {**PAIRS, "runs": {"reward_run": "reward-model"}}),
    (PPO, {"max_new_tokens": 4, "ppo_epochs": 1, "whiten_scores": False, "clip_range_value": None},
     {"runs": {"reward_run": "reward-model"}}),
    (Distill, None, TEACHER),
    (Distill, {"packing": False, "alpha": 1.0, "temperature": 1.0}, TEACHER),
]


@pytest.mark.parametrize("plugin, options, settings", CASES, ids=[f"{p.__name__}-{o}" for p, o, _ in CASES])
def test_objective_conforms(plugin, options, settings):
    check_objective(plugin, options, **settings)


def test_mlm_with_a_code_mask_rate_conforms_on_a_corpus_without_code():
    check_objective(MLM, {"code_mask_rate": 0.5})
