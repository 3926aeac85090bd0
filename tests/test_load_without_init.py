"""A trained run loaded back is built without random initialisation (every parameter comes from its
checkpoint): the load draws nothing from the random generator and gives the checkpoint's values; an
objective's new head, which no checkpoint holds, is started by its own initialisation."""

import math

import torch

from lmlab.checkpoint import best_or_last, load, state_of
from lmlab.trained import load_run


def test_loading_a_run_draws_no_random_numbers_and_gives_the_checkpoint_s_weights(trained_run):
    torch.manual_seed(1234)
    before = torch.random.get_rng_state()
    run = load_run(trained_run)
    assert torch.equal(torch.random.get_rng_state(), before)  # nothing was drawn to be thrown away
    saved = state_of(load(best_or_last(trained_run)))
    loaded = run.model.state_dict()
    assert set(saved) == set(loaded)
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)


def test_a_new_objective_s_head_is_started_by_its_own_initialisation(trained_run):
    torch.manual_seed(0)
    run = load_run(trained_run, ["objective.use=reward-model"])
    (head,) = run.model.heads.values()
    d_model = head.in_features
    assert torch.isfinite(head.weight).all() and torch.equal(head.bias, torch.zeros_like(head.bias))
    # RewardHead's own scheme: normal with std 1/sqrt(d_model + 1), not the unfilled memory it was built with.
    assert 0.5 < head.weight.std().item() * math.sqrt(d_model + 1) < 1.6
