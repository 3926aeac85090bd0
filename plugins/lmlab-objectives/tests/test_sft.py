"""Properties of the ``sft`` objective: targets scored exactly where the loss mask of the *target* token
is 1, padding never scored, and a loss over response tokens only."""

import numpy as np
import pytest
import torch

from lmlab.api import IGNORE_INDEX, Batch, TokenSplit, UserError, Windows
from lmlab_objectives.sft import SFT

V = 20


def objective(**options) -> SFT:
    return SFT(SFT.Options(**options))


def test_target_t_is_scored_exactly_when_the_mask_at_t_plus_1_is_set():
    # one row: prompt p p p, response r r, end e, then the next record's prompt
    tokens = torch.tensor([[1, 2, 3, 10, 11, 0, 4, 5]])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 0, 0]], dtype=torch.uint8)
    batch = objective(packing=True).make_batch_from(Windows(tokens, labels=mask))
    assert batch.input_ids.tolist() == [[1, 2, 3, 10, 11, 0, 4]]
    I = IGNORE_INDEX
    # the model learns to produce 10 after the prompt, 11 after 10, and the end after the response,
    # and never a prompt token
    assert batch.targets.tolist() == [[I, I, 10, 11, 0, I, I]]


def test_padding_is_never_scored():
    tokens = torch.tensor([[1, 2, 10, 11, 0, 0, 0], [1, 10, 11, 12, 13, 14, 15]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1]], dtype=torch.uint8)
    padding = torch.tensor([[False] * 4 + [True] * 3, [False] * 7])
    batch = objective().make_batch_from(Windows(tokens, labels=mask, padding=padding))
    I = IGNORE_INDEX
    assert batch.targets.tolist() == [[I, 10, 11, I, I, I], [10, 11, 12, 13, 14, 15]]


def test_packing_chooses_the_sampling():
    assert objective(packing=True).sampling == "windows" and objective(packing=False).sampling == "documents"
    assert objective().sampling == "documents" and SFT.wants_windows() and SFT.causal


def test_labels_are_the_prepared_loss_mask_at_the_sampled_positions():
    mask = np.array([0, 0, 1, 1, 0, 1], dtype=np.uint8)
    split = TokenSplit("train", np.arange(6, dtype=np.uint16), mask, np.array([0, 4]), None)
    labels = objective().token_labels(split)
    np.testing.assert_array_equal(labels(np.array([[1, 2, 3], [3, 4, 5]])), [[0, 1, 1], [1, 0, 1]])


def test_a_corpus_without_a_loss_mask_is_refused_naming_the_objective():
    split = TokenSplit("train", np.arange(6, dtype=np.uint16), None, np.array([0]), None)
    with pytest.raises(UserError, match="alpaca") as info:
        objective().token_labels(split)
    assert info.value.key == "objective.use"


def test_loss_is_the_cross_entropy_over_response_targets_only():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, V, (3, 9), generator=g)
    mask = torch.zeros(3, 9, dtype=torch.uint8)
    mask[:, 5:] = 1  # the last four tokens of each row are the response
    sft = objective()
    batch = sft.make_batch_from(Windows(tokens, labels=mask))
    logits = torch.randn(3, 8, V, generator=g) * 2
    log_probs = logits.double().log_softmax(-1)
    # by hand: targets t = 4..7 (tokens 5..8), the response
    picked = log_probs[:, 4:].gather(-1, tokens[:, 5:, None])[..., 0]
    assert sft.loss(logits, batch).item() == pytest.approx(-picked.mean().item(), rel=1e-6)

    prompt_changed = logits.clone()
    prompt_changed[:, :4] = torch.randn(3, 4, V, generator=g) * 10  # logits at prompt targets do not matter
    assert sft.loss(prompt_changed, batch).item() == pytest.approx(sft.loss(logits, batch).item(), rel=1e-6)
    other_prompt = tokens.clone()
    other_prompt[:, 1:5] = (tokens[:, 1:5] + 1) % V  # other prompt targets: the same loss
    assert sft.loss(logits, sft.make_batch_from(Windows(other_prompt, labels=mask))).item() == \
        pytest.approx(sft.loss(logits, batch).item(), rel=1e-6)
    other_response = tokens.clone()
    other_response[:, 6] = (tokens[:, 6] + 1) % V  # another response: another loss
    assert sft.loss(logits, sft.make_batch_from(Windows(other_response, labels=mask))).item() != \
        pytest.approx(sft.loss(logits, batch).item(), rel=1e-6)


def test_a_batch_with_nothing_scored_has_zero_loss_not_nan():
    tokens = torch.randint(0, V, (2, 5))
    batch = objective().make_batch_from(Windows(tokens, labels=torch.zeros(2, 5, dtype=torch.uint8)))
    assert (batch.targets == IGNORE_INDEX).all()
    logits = torch.randn(2, 4, V, requires_grad=True)
    loss = objective().loss(logits, batch)
    loss.backward()
    assert loss.item() == 0.0 and logits.grad.abs().sum() == 0


def test_z_loss_applies_to_scored_positions_as_in_causal_lm():
    from lmlab_objectives.causal_lm import CausalLM

    tokens = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1]], dtype=torch.uint8)
    batch = objective(z_loss=1e-2).make_batch_from(Windows(tokens, labels=mask))
    logits = torch.randn(2, 5, V, generator=torch.Generator().manual_seed(2))
    reference = CausalLM(CausalLM.Options(z_loss=1e-2)).loss(logits, batch)
    assert objective(z_loss=1e-2).loss(logits, batch).item() == pytest.approx(reference.item(), rel=1e-6)


def test_sft_batches_are_plain_batches():
    batch = objective().make_batch_from(Windows(torch.zeros(1, 3, dtype=torch.long),
                                                labels=torch.ones(1, 3, dtype=torch.uint8)))
    assert isinstance(batch, Batch) and batch.input_ids.shape == (1, 2)
