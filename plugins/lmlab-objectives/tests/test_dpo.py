"""``dpo``: the loss equals a hand computation, and a step raises the chosen answer's log-probability
relative to the rejected one's; preference rows split into the two sequences as the mask says."""

import math

import pytest
import torch

from lmlab.api import IGNORE_INDEX, Windows
from lmlab_objectives.dpo import DPO, dpo_loss
from lmlab_objectives.pairs import split_pairs

I = IGNORE_INDEX


def test_rows_split_into_prompt_plus_chosen_and_prompt_plus_rejected(pair_windows):
    batch = split_pairs(pair_windows)
    assert batch.input_ids.tolist() == [[1, 2, 3, 0, 0, 0], [6, 7, 8, 0, 0, 0],
                                        [1, 2, 4, 5, 0, 0], [6, 9, 0, 0, 0, 0]]
    assert batch.targets.tolist() == [[I, 3, I, I, I, I], [7, 8, I, I, I, I],
                                      [I, 4, 5, I, I, I], [9, I, I, I, I, I]]
    assert batch.last.tolist() == [2, 2, 3, 1] and batch.valid.tolist() == [True, True]
    assert int(batch.n_scored()) == 2


def test_a_record_cut_by_the_row_end_is_left_out(pair_windows):
    w = pair_windows
    cut = Windows(w.tokens[:, :4], labels=w.labels[:, :4], padding=w.padding[:, :4])
    assert split_pairs(cut).valid.tolist() == [False, False]  # neither row ends in padding: maybe cut


def test_the_chosen_sequence_gets_the_end_token_the_rejected_one_has():
    tokens = torch.tensor([[1, 2, 3, 4, 11, 0]])  # 11: end of document, after the rejected answer
    labels = torch.tensor([[0, 0, 1, 2, 2, 0]], dtype=torch.uint8)
    padding = torch.tensor([[0, 0, 0, 0, 0, 1]], dtype=torch.bool)
    batch = split_pairs(Windows(tokens, labels=labels, padding=padding), eos_id=11)
    assert batch.input_ids.tolist() == [[1, 2, 3, 11, 0], [1, 2, 4, 11, 0]]
    assert batch.targets.tolist() == [[I, 3, 11, I, I], [I, 4, 11, I, I]]


def test_the_loss_variants_equal_their_formulas():
    pc, pr, rc, rr = (torch.tensor([v]) for v in (-3.0, -4.0, -3.5, -3.5))
    h, beta = 1.0, 0.5  # (pc - rc) - (pr - rr) = 0.5 + 0.5
    assert dpo_loss(pc, pr, rc, rr, beta).item() == pytest.approx(math.log1p(math.exp(-beta * h)))
    assert dpo_loss(pc, pr, rc, rr, beta, "ipo").item() == pytest.approx((h - 1 / (2 * beta)) ** 2)
    assert dpo_loss(pc, pr, rc, rr, beta, "hinge").item() == pytest.approx(max(0.0, 1 - beta * h))
    smoothed = dpo_loss(pc, pr, rc, rr, beta, label_smoothing=0.1).item()
    sig = 1 / (1 + math.exp(-beta * h))
    assert smoothed == pytest.approx(-0.9 * math.log(sig) - 0.1 * math.log(1 - sig))


def _log_prob(logits: torch.Tensor, ids: list[int], targets: list[int]) -> float:
    """Σ over scored targets of log softmax(logits)[target], by hand."""
    total = 0.0
    for t, target in enumerate(targets):
        if target != I:
            row = logits[t].double()
            total += float(row[target] - torch.logsumexp(row, dim=0))
    return total


def objective(reference, beta: float = 0.1) -> DPO:
    dpo = DPO(DPO.Options(beta=beta))
    dpo.eos_id = None
    dpo.reference = reference
    return dpo


def test_the_batch_loss_equals_a_hand_computation_on_a_tiny_batch(tiny_lm, pair_windows):
    policy, reference = tiny_lm(seed=0), tiny_lm(seed=1).eval()
    dpo = objective(reference, beta=0.3)
    batch = dpo.make_batch_from(pair_windows)
    loss = dpo.forward_loss(policy, batch)
    with torch.no_grad():
        p_logits, r_logits = policy(batch.input_ids), reference(batch.input_ids)
    expected = 0.0
    for k in range(2):  # pair k: chosen row k, rejected row 2 + k
        rows = [(k, "chosen"), (2 + k, "rejected")]
        lp = {name: _log_prob(p_logits[r], batch.input_ids[r].tolist(), batch.targets[r].tolist()) for r, name in rows}
        lr = {name: _log_prob(r_logits[r], batch.input_ids[r].tolist(), batch.targets[r].tolist()) for r, name in rows}
        h = (lp["chosen"] - lr["chosen"]) - (lp["rejected"] - lr["rejected"])
        expected += math.log1p(math.exp(-0.3 * h)) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    reports = dpo.take_reports()
    assert {"reward_accuracy", "policy_accuracy", "reward_margin", "chosen_reward", "rejected_reward"} <= set(reports)


def test_one_step_raises_the_chosen_answer_relative_to_the_rejected(tiny_lm, pair_windows):
    policy = tiny_lm(seed=0)
    dpo = objective(tiny_lm(seed=1).eval())
    batch = dpo.make_batch_from(pair_windows)

    def margins():
        with torch.no_grad():
            logits = policy(batch.input_ids)
        lp = [_log_prob(logits[r], [], batch.targets[r].tolist()) for r in range(4)]
        return [lp[0] - lp[2], lp[1] - lp[3]]  # log π(chosen) − log π(rejected), per pair

    before = margins()
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.5)
    dpo.forward_loss(policy, batch).backward()
    optimizer.step()
    after = margins()
    assert all(a > b for a, b in zip(after, before)), (before, after)


def test_the_reference_gets_no_gradient(tiny_lm, pair_windows):
    reference = tiny_lm(seed=1).eval()
    dpo = objective(reference)
    dpo.forward_loss(tiny_lm(seed=0), dpo.make_batch_from(pair_windows)).backward()
    assert all(p.grad is None for p in reference.parameters())
