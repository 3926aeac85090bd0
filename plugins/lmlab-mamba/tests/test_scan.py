"""The chunked selective scan against the recurrence written out step by step, in float32."""

import pytest
import torch
import torch.nn.functional as F

from lmlab_mamba.scan import CHUNK_STATES, MAX_CHUNK, MIN_CHUNK, auto_chunk_size, selective_scan, selective_step

T, BATCH, D, N = 37, 3, 10, 5


def sequential_scan(x, dt, A, B, C, h0):
    """h_t = exp(Δ_t A) h_{t-1} + Δ_t x_t B_t; y_t = C_t · h_t, one time step after another."""
    h, ys = h0, []
    for t in range(x.shape[1]):
        h = torch.exp(dt[:, t, :, None] * A) * h + (dt[:, t] * x[:, t])[:, :, None] * B[:, t, None, :]  # (Bt, D, N)
        ys.append((h * C[:, t, None, :]).sum(-1))                                                      # (Bt, D)
    return torch.stack(ys, 1), h


def inputs(dt_scale: float = 1.0, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, BATCH, D, generator=g)
    dt = F.softplus(torch.randn(T, BATCH, D, generator=g) - 1.0) * dt_scale
    A = -torch.exp(torch.randn(D, N, generator=g))      # a spread of decay rates, as a trained A_log gives
    B = torch.randn(T, BATCH, N, generator=g)
    C = torch.randn(T, BATCH, N, generator=g)
    h0 = torch.randn(BATCH, D, N, generator=g)
    x, dt, B, C = (t.transpose(0, 1).contiguous() for t in (x, dt, B, C))  # (BATCH, T, ·)
    return [t.requires_grad_() for t in (x, dt, A, B, C, h0)]


def outputs_and_grads(scan, args, weights):
    y, h = scan(*args)
    loss = (y * weights[0]).sum() + (h * weights[1]).sum()
    return (y, h), torch.autograd.grad(loss, args)


@pytest.mark.parametrize("chunk_size", [1, 3, 5, 8, 16, 64])
def test_chunked_scan_equals_the_sequential_recurrence_for_any_chunk_size(chunk_size):
    # T = 37 is prime: every chunk size above 1 leaves a shorter last chunk; 64 > T is one chunk.
    args = inputs()
    weights = torch.randn(BATCH, T, D), torch.randn(BATCH, D, N)
    (y, h), grads = outputs_and_grads(lambda *a: selective_scan(*a, chunk_size=chunk_size), args, weights)
    (y_ref, h_ref), grads_ref = outputs_and_grads(sequential_scan, args, weights)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h, h_ref, atol=1e-5, rtol=1e-5)
    # The backward pass is written by hand: every input's gradient must match autograd's through the loop.
    for name, grad, grad_ref in zip(["x", "dt", "A", "B", "C", "h0"], grads, grads_ref):
        scale = grad_ref.abs().max()
        assert (grad - grad_ref).abs().max() <= 1e-5 * max(scale, 1.0), name


def test_the_automatic_chunk_fills_the_state_budget_with_a_power_of_two():
    cpu = torch.device("cpu")
    for rows in (1, 2, 3, 12, 32, 64, 1000):
        for d_inner, d_state in ((256, 16), (512, 16), (64, 4), (4096, 128)):
            length = auto_chunk_size(rows, d_inner, d_state, cpu)
            assert MIN_CHUNK <= length <= MAX_CHUNK and length & (length - 1) == 0
            states = rows * length * d_state * d_inner
            assert length == MIN_CHUNK or states <= CHUNK_STATES        # fits, unless already the shortest
            assert length == MAX_CHUNK or 2 * states > CHUNK_STATES     # and the next doubling would not
    # The quickstart's mixer (12 rows, d_inner 256, d_state 16) keeps its 8 steps; one long row gets 64.
    assert auto_chunk_size(12, 256, 16, cpu) == 8 and auto_chunk_size(1, 256, 16, cpu) == 64
    assert auto_chunk_size(12, 256, 16, torch.device("meta")) == MAX_CHUNK


def test_the_automatic_chunk_gives_the_recurrence_too():
    args = inputs()
    y, h = selective_scan(*args)            # chunk_size None: auto, here 64 (> T: the whole sequence at once)
    y_ref, h_ref = sequential_scan(*args)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h, h_ref, atol=1e-5, rtol=1e-5)


def test_scan_without_an_initial_state_starts_from_zeros():
    x, dt, A, B, C, _ = inputs()
    y, h = selective_scan(x, dt, A, B, C, None, chunk_size=8)
    y_ref, h_ref = sequential_scan(x, dt, A, B, C, torch.zeros(BATCH, D, N))
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h, h_ref, atol=1e-5, rtol=1e-5)


def test_scan_in_two_pieces_seeded_with_the_first_state_equals_one_scan():
    x, dt, A, B, C, h0 = inputs()
    y, h = selective_scan(x, dt, A, B, C, h0, chunk_size=4)
    y1, h1 = selective_scan(x[:, :20], dt[:, :20], A, B[:, :20], C[:, :20], h0, chunk_size=4)
    y2, h2 = selective_scan(x[:, 20:], dt[:, 20:], A, B[:, 20:], C[:, 20:], h1, chunk_size=4)
    torch.testing.assert_close(torch.cat([y1, y2], 1), y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h2, h, atol=1e-5, rtol=1e-5)


def test_single_steps_equal_the_scan():
    x, dt, A, B, C, h0 = inputs()
    h, ys = h0, []
    for t in range(T):
        y_t, h = selective_step(x[:, t], dt[:, t], A, B[:, t], C[:, t], h)
        ys.append(y_t)
    y_ref, h_ref = selective_scan(x, dt, A, B, C, h0, chunk_size=8)
    torch.testing.assert_close(torch.stack(ys, 1), y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h, h_ref, atol=1e-5, rtol=1e-5)


def assert_finite_and_equal_to_the_recurrence(x, dt, A, B, C, h0, chunk_size):
    y, h = selective_scan(x, dt, A, B, C, h0, chunk_size=chunk_size)
    y_ref, h_ref = sequential_scan(x, dt, A, B, C, h0)
    assert torch.isfinite(y).all() and torch.isfinite(h).all()
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h, h_ref, atol=1e-5, rtol=1e-5)
    grads = torch.autograd.grad(y.square().sum(), (x, dt, A, B, C, h0))
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("chunk_size", [3, 8, 64])
def test_decays_beyond_float32s_exponent_range_stay_finite_and_accurate(chunk_size):
    # Δ up to ~60 and |A| up to ~20: one step can decay by e^-1000, a chunk by far more. A scan in log
    # space (exp(S) and exp(-S) of running sums) overflows to inf and NaN here; products of decays ≤ 1
    # underflow to 0 at worst, which is what the recurrence does too.
    x, dt, A, B, C, h0 = inputs(dt_scale=30.0)
    assert float((dt.max() * -A.min()).detach()) > 88.7  # e^88.7: float32's largest
    assert_finite_and_equal_to_the_recurrence(x, dt, A, B, C, h0, chunk_size)


def test_one_sharp_decay_at_a_chunks_start_stays_finite_and_accurate():
    # The whole decay of a chunk in its first step, which every product of the prefix and suffix contains.
    x, dt, A, B, C, h0 = inputs(dt_scale=0.1)
    with torch.no_grad():
        dt[:, 8] = 5.0  # first step of the second chunk of 8: decays by up to 5 · max|A| ≈ 60, e^-60
        dt[:, 17] = 20.0
    assert_finite_and_equal_to_the_recurrence(x, dt, A, B, C, h0, chunk_size=8)


def test_scan_runs_without_autograd_and_gives_the_same_result():
    args = inputs()
    with torch.no_grad():
        y, h = selective_scan(*args, chunk_size=8)
    y_ref, h_ref = selective_scan(*args, chunk_size=8)
    torch.testing.assert_close(y, y_ref, atol=0, rtol=0)
    torch.testing.assert_close(h, h_ref, atol=0, rtol=0)


def test_mixed_precision_does_not_reach_the_scan():
    args = inputs()
    y, h = selective_scan(*args, chunk_size=8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_amp, h_amp = selective_scan(*args, chunk_size=8)
        y_step, _ = selective_step(*(a[:, 0] for a in args[:2]), args[2], args[3][:, 0], args[4][:, 0], args[5])
    assert y_amp.dtype == h_amp.dtype == y_step.dtype == torch.float32
    torch.testing.assert_close(y_amp, y, atol=0, rtol=0)
    y_step_ref, _ = selective_step(*(a[:, 0] for a in args[:2]), args[2], args[3][:, 0], args[4][:, 0], args[5])
    torch.testing.assert_close(y_step, y_step_ref, atol=0, rtol=0)


def test_a_second_backward_through_the_same_scan_gives_the_same_gradients():
    # Only each chunk's starting state is kept; the backward pass recomputes the rest, so it can run again.
    args = inputs()
    y, _ = selective_scan(*args, chunk_size=8)
    first = torch.autograd.grad(y.sum(), args, retain_graph=True)
    second = torch.autograd.grad(y.sum(), args)
    for g1, g2 in zip(first, second):
        torch.testing.assert_close(g1, g2, atol=0, rtol=0)
