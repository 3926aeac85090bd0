import pytest
import torch

from lmlab.api import IGNORE_INDEX, Batch
from lmlab_objectives.causal_lm import CausalLM

B, T, V = 3, 5, 11


def objective(**options):
    return CausalLM(CausalLM.Options(**options))


def explicit_nll(logits, targets):
    """Mean over counted positions of -log softmax(logits)[target], written out by hand."""
    logits = logits.double()
    log_probs = logits - logits.exp().sum(-1, keepdim=True).log()  # (B, T, V)
    counted = targets != IGNORE_INDEX
    picked = log_probs.gather(-1, targets.clamp(min=0)[..., None])[..., 0]  # (B, T)
    return -(picked * counted).sum() / counted.sum(), logits.exp().sum(-1).log(), counted


def random_case(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, V, generator=g) * 3, torch.randint(0, V, (B, T), generator=g)


def test_make_batch_predicts_the_next_token():
    windows = torch.arange(2 * 6).view(2, 6)
    batch = objective().make_batch(windows)
    assert torch.equal(batch.input_ids, windows[:, :-1])
    assert torch.equal(batch.targets, windows[:, 1:])
    assert torch.equal(batch.targets[:, :-1], batch.input_ids[:, 1:])


def test_loss_is_the_mean_negative_log_likelihood_of_the_targets():
    logits, targets = random_case()
    loss = objective().loss(logits, Batch(torch.zeros_like(targets), targets))
    expected, _, _ = explicit_nll(logits, targets)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)


def test_ignored_targets_contribute_nothing():
    logits, targets = random_case(1)
    targets[0, :3] = IGNORE_INDEX
    targets[2, -1] = IGNORE_INDEX
    loss = objective().loss(logits, Batch(torch.zeros_like(targets), targets))
    expected, _, _ = explicit_nll(logits, targets)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    changed = logits.clone()
    changed[0, :3] = torch.randn(3, V) * 10  # logits at ignored positions do not matter
    assert objective().loss(changed, Batch(targets, targets)).item() == pytest.approx(loss.item(), rel=1e-6)


def test_bf16_logits_give_a_float32_loss_close_to_the_exact_one():
    logits, targets = random_case(2)
    loss = objective().loss(logits.bfloat16(), Batch(targets, targets))
    assert loss.dtype == torch.float32
    expected, _, _ = explicit_nll(logits.bfloat16().float(), targets)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)


def test_z_loss_adds_the_mean_squared_log_normaliser_of_counted_positions():
    logits, targets = random_case(3)
    targets[1, 1] = IGNORE_INDEX
    nll, log_z, counted = explicit_nll(logits, targets)
    expected = nll + 1e-2 * (log_z.square() * counted).sum() / counted.sum()
    loss = objective(z_loss=1e-2).loss(logits, Batch(targets, targets))
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert loss.item() > objective().loss(logits, Batch(targets, targets)).item()


def test_loss_gradient_flows_to_the_logits():
    logits, targets = random_case(4)
    logits.requires_grad_(True)
    objective(z_loss=1e-4).loss(logits, Batch(targets, targets)).backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0
