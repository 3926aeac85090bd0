"""Mamba's selective scan in plain PyTorch: chunked and parallel for training, one step for decoding.

The recurrence, for each batch row, channel d and state index n (Gu & Dao 2023, eq. 2, with the
zero-order hold for A and the Euler step for B of the reference implementation)::

    h_t = exp(Δ_t A) ⊙ h_{t-1} + (Δ_t x_t) B_t        h: (N, D) here, (D, N) in the state object
    y_t = C_t · h_t                                    y: (D,)

Training runs it chunk by chunk, in a Python loop over T / L chunks, never over time steps; only each
chunk's last state is carried to the next. Inside a chunk of L steps all states come at once from the
log-depth parallel prefix of Sklansky (1960): the steps h ↦ a_t h + u_t compose associatively, so in
log2(L) rounds the second half of every block of 2^k steps takes in the last state of the first half,
``h[second] += a[second] ⊙ h[last of first]``, and its running decay products take in the first
half's, ``a[second] *= a[last of first]``. Each round is two in-place broadcasting products over half
the chunk, views of one buffer. Every round is another pass over the states, so chunks are short, but
every chunk costs each of its ops' fixed overhead once more: :func:`auto_chunk_size` sizes them so that
a chunk's states fill the CPU's caches, 8 steps at the quickstart's batch of 12 and up to 64 for one
long sequence.

Every factor is a decay a_t = exp(Δ_t A) ≤ 1 and every sum one of states, so nothing can overflow and
the result matches the recurrence to rounding for any Δ. A scan in log space (products as exp(S_t) ·
exp(-S_s) of running sums S, the sums as a triangular matrix product) needs exponents bounded by a
reference point and chunks cut where decays are large, and its (L, L) @ (L, Bt·N·D) product is a slow
GEMM on a CPU; ``cumsum`` along the time axis is slower still.

The backward pass is written out: the adjoint of a linear recurrence is the same recurrence run
backwards, dL/dh_t = C_t gy_t + a_{t+1} dL/dh_{t+1}, the same prefix mirrored in time. The forward
pass keeps only the state each chunk starts from; the backward pass recomputes a chunk's decays and
states from it just before it needs them: the states of a step are tens of MB, far past the caches,
so writing them out and reading them back costs about what recomputing them does, and keeping them
would hold that memory for the whole step.

Layout, for the CPU: float32 states (Bt, L, N, D) with batch rows outermost and channels last. A
step's decays and inputs are then broadcasting products of (Bt, L, 1, D) and (Bt, L, N, 1) rows, the
reductions over N or D (y = C · h and the gradients of B, C and x) are (1, ·) @ (·, ·) products batched
over (row, step), which read the states once and write nothing of their size, and exponentials are
``exp2`` (several times faster than ``exp`` in PyTorch's CPU kernels). Batch rows outermost matters
with several threads: an op splits its elements between threads in memory order, so every op of a
chunk gives each thread the same batch rows and each core keeps working on data in its own cache.
Time-major buffers (L, Bt, N, D) would split by steps instead, differently for the full-chunk ops and
the half-chunk rounds, moving the data between the cores' caches at every op.

Memory: every buffer that does not leave the scan comes from a pool of flat buffers reused from one
call to the next (:class:`_BufferPool`), the chunk-major copies of the inputs and the chunk starts kept
for the backward pass included; fresh pages cost the CPU more than the scan's arithmetic on them.
"""

import math
import weakref

import torch
from torch.autograd.function import once_differentiable

LOG2_E = 1.0 / math.log(2.0)
# The most float32 states one chunk may hold under auto_chunk_size: 2 MiB, a two-core CPU's L2 caches
# (how close it comes to the best length: bench/mamba_chunks.py, and the plugin's README).
CHUNK_STATES = 2 ** 19
MIN_CHUNK, MAX_CHUNK = 4, 64


def auto_chunk_size(batch_rows: int, d_inner: int, d_state: int, device: torch.device) -> int:
    """The chunk length for this many rows and this state size: on a CPU the largest power of two in
    [4, 64] whose states fit in CHUNK_STATES (each chunk's ops then run in the caches, and there are as
    few chunks as that allows); elsewhere 64, the fewest chunks, since each op's launch is what costs
    there (not measured: this machine has no GPU)."""
    if device.type != "cpu":
        return MAX_CHUNK
    length = MIN_CHUNK
    while length < MAX_CHUNK and batch_rows * 2 * length * d_state * d_inner <= CHUNK_STATES:
        length *= 2
    return length


def selective_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   h0: torch.Tensor | None = None, chunk_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence above over T steps, in chunks of ``chunk_size`` (None: :func:`auto_chunk_size`).

    x, dt (Bt, T, D); A (D, N) ≤ 0; B, C (Bt, T, N); h0 (Bt, D, N) or None for zeros; all float32.
    Returns y (Bt, T, D) and the last state h_T (Bt, D, N).
    """
    if h0 is None:
        h0 = x.new_zeros(x.shape[0], A.shape[0], A.shape[1])
    backward = torch.is_grad_enabled() and any(t.requires_grad for t in (x, dt, A, B, C, h0))
    with torch.autocast(x.device.type, enabled=False):  # mixed precision must not reach the scan
        return _ChunkedScan.apply(x, dt, A, B, C, h0, chunk_size, backward)


def selective_step(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One recurrent step (decoding): x, dt (Bt, D); B, C (Bt, N); h (Bt, D, N) → y (Bt, D), new h."""
    h = torch.exp(dt[..., None] * A) * h + (dt * x)[..., None] * B[:, None, :]  # (Bt, D, N)
    return (h * C[:, None, :]).sum(-1), h  # elementwise, so mixed precision (autocast) leaves it in float32


def _prefix_rounds(h: torch.Tensor, a: torch.Tensor) -> list[tuple]:
    """Sklansky's rounds that turn the inputs u_t in ``h`` (Bt, l, ...) into the states
    h_t = a_t h_{t-1} + u_t (from h_{-1} = 0), as (h_to, a_to, h_from, a_from) views of h and of the
    decays ``a``, which they overwrite with running products; a_from is None where no later round reads
    the products. A block cut short by the end of the chunk does the same on the steps it has."""
    rounds, l, s = [], h.shape[1], 1
    while s < l:
        full = l // (2 * s) * 2 * s                                  # steps in whole blocks of 2s
        later = 2 * s < l
        if full:
            hv, av = (t[:, :full].unflatten(1, (full // (2 * s), 2 * s)) for t in (h, a))
            rounds.append((hv[:, :, s:], av[:, :, s:], hv[:, :, s - 1:s], av[:, :, s - 1:s] if later else None))
        if l - full > s:
            rounds.append((h[:, full + s:], a[:, full + s:], h[:, full + s - 1:full + s],
                           a[:, full + s - 1:full + s] if later else None))
        s *= 2
    return rounds


def _suffix_rounds(g: torch.Tensor, a: torch.Tensor) -> list[tuple]:
    """:func:`_prefix_rounds` mirrored in time, g_t = a_t g_{t+1} + c_t from g_l = 0, where a_t is the
    decay from step t to t + 1 (a_{l-1}, past the chunk's end, only enters products that no round
    reads). Blocks are aligned to the end of the chunk."""
    rounds, l, s = [], g.shape[1], 1
    while s < l:
        start = l % (2 * s)                                          # steps before the first whole block
        later = 2 * s < l
        if start < l:
            gv, av = (t[:, start:].unflatten(1, ((l - start) // (2 * s), 2 * s)) for t in (g, a))
            rounds.append((gv[:, :, :s], av[:, :, :s], gv[:, :, s:s + 1], av[:, :, s:s + 1] if later else None))
        if start > s:
            rounds.append((g[:, :start - s], a[:, :start - s], g[:, start - s:start - s + 1],
                           a[:, start - s:start - s + 1] if later else None))
        s *= 2
    return rounds


def _run(rounds: list[tuple]) -> None:
    for h_to, a_to, h_from, a_from in rounds:
        h_to.addcmul_(a_to, h_from)
        if a_from is not None:
            a_to.mul_(a_from)


class _BufferPool:
    """Large flat buffers handed back after use and taken again by the next scan of the same size.

    A CPU allocator returns big blocks to the operating system when they are freed, and touching fresh
    pages costs more than the scan's arithmetic on them. Buffers in use belong to their scan alone; the
    pool keeps only
    what was given back, so it holds at most the buffers of the largest number of scans that were
    alive at once.
    """

    def __init__(self):
        self.free: dict[tuple, list[torch.Tensor]] = {}

    def take(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        stack = self.free.get((numel, like.device, like.dtype))
        return stack.pop() if stack else like.new_empty(numel)

    def give(self, *buffers: torch.Tensor) -> None:
        for buf in buffers:
            self.free.setdefault((buf.numel(), buf.device, buf.dtype), []).append(buf)


_POOL = _BufferPool()


def _buffers(like: torch.Tensor, *shapes: tuple[int, ...]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Buffers of the given shapes, carved from one pooled flat buffer (returned first, to give back)."""
    sizes = [math.prod(shape) for shape in shapes]
    flat = _POOL.take(sum(sizes), like)
    return flat, [part.view(shape) for part, shape in zip(flat.split(sizes), shapes)]


def _chunk_into(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Copy (Bt, T, k) into ``out`` (n, Bt, L, k), chunk-major, zeros past T; returns ``out``."""
    n, Bt, L, k = out.shape
    T = t.shape[1]
    full = T // L
    if full:
        out[:full].copy_(t[:, :full * L].view(Bt, full, L, k).transpose(0, 1))
    if full < n:  # the last chunk, cut short
        out[full].zero_()
        out[full, :, :T - full * L].copy_(t[:, full * L:])
    return out


def _unchunked(t: torch.Tensor, T: int) -> torch.Tensor:
    """(n, Bt, L, k) chunk-major → a new (Bt, T, k), the padding dropped (never a view of ``t``, which
    may be a pooled buffer)."""
    n, Bt, L, k = t.shape
    out = t.new_empty(Bt, n * L, k)
    out.view(Bt, n, L, k).copy_(t.transpose(0, 1))
    return out[:, :T]


class _ChunkedScan(torch.autograd.Function):
    """Forward and backward of :func:`selective_scan` (see :func:`scan_forward` and :func:`scan_backward`)."""

    @staticmethod
    def forward(ctx, x, dt, A, B, C, h0, chunk_size, training):
        if training:  # the arguments themselves: torch.compile refuses to save views of them
            ctx.save_for_backward(x, dt, A, B, C)
        y, h_last, ctx.kept = scan_forward(x, dt, A, B, C, h0, chunk_size, training)
        return y, h_last

    @staticmethod
    @once_differentiable
    def backward(ctx, gy, gh_last):
        with torch.autocast(gy.device.type if gy is not None else gh_last.device.type, enabled=False):
            return *scan_backward(*ctx.saved_tensors, ctx.kept, gy, gh_last), None, None


class ChunkStarts:
    """What the backward pass of a scan needs besides its inputs: the chunk length and the state each
    chunk starts from, in a pooled buffer that goes back to the pool with this object (and so with the
    graph that holds it: a second backward pass reads the starts too)."""

    def __init__(self, length: int, starts: torch.Tensor, pooled: torch.Tensor | None):
        self.length, self.starts = length, starts
        if pooled is not None:
            weakref.finalize(self, _POOL.give, pooled)


def scan_forward(x, dt, A, B, C, h0, chunk_size, training) -> tuple[torch.Tensor, torch.Tensor, ChunkStarts | None]:
    """y (Bt, T, D) and h_T (Bt, D, N) of the recurrence from h0 (None: zeros) in chunks of
    ``chunk_size`` (None: :func:`auto_chunk_size`), and with ``training`` what :func:`scan_backward`
    needs of this call (else None). No autograd: the callers are autograd Functions.

    The (Bt, T, ·) inputs are copied once into chunk-major (n, Bt, L, ·) tensors, padded with zeros to
    whole chunks (Δ = 0 there: a decay of 1 and no input, so a padded step passes the state on
    unchanged), so that every chunk is a contiguous block of the same shape, split into per-chunk views
    once: the loop over chunks does no slicing or copying of inputs and outputs. Every buffer that does
    not leave the function comes from the pool, the chunk starts kept for the backward pass included.
    """
    At2 = A.t().contiguous() * LOG2_E                                    # (N, D) A in base-2 units
    Bt, T, D = x.shape
    N = At2.shape[0]
    if chunk_size is None:
        chunk_size = auto_chunk_size(Bt, D, N, x.device)
    L = max(1, min(chunk_size, T))
    n = -(-T // L)
    flat, (hs, a, dt_c, v_c, B_c, C_c, y_c) = _buffers(
        x, (Bt, L, N, D), (Bt, L, N, D), (n, Bt, L, D), (n, Bt, L, D), (n, Bt, L, N), (n, Bt, L, N),
        (n, Bt * L, 1, D))
    _chunk_into(dt_c, dt)
    _chunk_into(v_c, x).mul_(dt_c)                                       # Δ_t x_t
    _chunk_into(B_c, B)
    _chunk_into(C_c, C)
    prefix, hs_r, hs_last = _prefix_rounds(hs, a), hs.view(-1, N, D), hs[:, -1]
    start = (hs[:, 0], a[:, 0])
    # The state each chunk starts from and the last one: all of them when the backward pass will
    # recompute the chunks from them, else the two in use.
    count = n + 1 if training else 2
    if torch.compiler.is_compiling():  # dynamo cannot keep a view of a pooled buffer for backward
        kept, starts = None, x.new_empty(count, Bt, N, D)
    else:
        kept, (starts,) = _buffers(x, (count, Bt, N, D))
    if h0 is None:
        starts[0].zero_()
    else:
        starts[0] = h0.transpose(1, 2)
    chunks = zip(dt_c[:, :, :, None].unbind(), v_c[:, :, :, None].unbind(), B_c[..., None].unbind(),
                 C_c.view(n, -1, 1, N).unbind(), y_c.unbind())
    slots = starts.unbind()
    for k, (dt_k, v_k, B_k, C_k, y_k) in enumerate(chunks):
        torch.mul(dt_k, At2, out=a).exp2_()                              # a_t = exp(Δ_t A)
        _states(hs, start, prefix, slots[k % len(slots)], v_k, B_k)
        torch.bmm(C_k, hs_r, out=y_k)                                    # y_t = C_t · h_t
        slots[(k + 1) % len(slots)].copy_(hs_last)
    y, h_last = _unchunked(y_c.view(n, Bt, L, D), T), starts[n % len(starts)].transpose(1, 2).clone()
    _POOL.give(flat)
    if training:
        return y, h_last, ChunkStarts(L, starts, kept)
    if kept is not None:
        _POOL.give(kept)
    return y, h_last, None


def scan_backward(x, dt, A, B, C, kept: ChunkStarts, gy, gh_last) -> tuple[torch.Tensor, ...]:
    """The gradients (x, dt, A, B, C, h0) of a :func:`scan_forward` call from those of y and h_T (either
    may be None: zero)."""
    At = A.t().contiguous()                                              # (N, D)
    At2 = At * LOG2_E
    Bt, T, D = x.shape
    N, L, starts = At.shape[0], kept.length, kept.starts
    n = starts.shape[0] - 1
    # Inputs and gradients chunk-major (n, Bt, L, ·); states, their decays (which the prefix
    # overwrites), gradients, decays for the suffix (one step more: the suffix reads a_{t+1} at step t;
    # zeroed so that the one past the chunk's end holds a number) and dL/dA per (row, step), summed
    # over chunks.
    flat, (x_c, dt_c, v_c, gy_c, gv_c, gdt_c, B_c, C_c, gB_c, gC_c, hs, a_fwd, gh, a, gA_steps) = _buffers(
        x, *[(n, Bt, L, D)] * 6, *[(n, Bt, L, N)] * 4, *[(Bt, L, N, D)] * 3, (Bt, L + 1, N, D), (Bt, L, N, D))
    for chunked, t in ((x_c, x), (dt_c, dt), (B_c, B), (C_c, C)):
        _chunk_into(chunked, t)
    torch.mul(dt_c, x_c, out=v_c)
    if gy is None:
        gy_c.zero_()
    else:
        _chunk_into(gy_c, gy)
    # G: dL/dh at the end of the chunk being processed, walking backwards from the last one.
    G = starts.new_zeros(Bt, N, D)
    if gh_last is not None:
        G.copy_(gh_last.transpose(1, 2))
    a.zero_()
    gA_steps.zero_()
    prefix, suffix = _prefix_rounds(hs, a_fwd), _suffix_rounds(gh, a[:, 1:])
    start, a_head, a0, gh0, gh_end = (hs[:, 0], a_fwd[:, 0]), a[:, :L], a[:, 0], gh[:, 0], gh[:, -1]
    hs_r, gh_r = hs.view(-1, N, D), gh.view(-1, N, D)
    hs_rt, gh_rt = hs_r.transpose(1, 2), gh_r.transpose(1, 2)
    slots = starts.unbind()
    rows = lambda t, k: t.view(n, -1, 1, k).unbind()                     # noqa: E731  (Bt·L, 1, k) each
    chunks = list(zip(dt_c[:, :, :, None].unbind(), v_c[:, :, :, None].unbind(), B_c[..., None].unbind(),
                      C_c[..., None].unbind(), gy_c[:, :, :, None].unbind(), rows(v_c, D), rows(B_c, N),
                      rows(gy_c, D), rows(gv_c, D), rows(gB_c, N), rows(gC_c, N), gdt_c.unbind()))
    for k in reversed(range(n)):
        dt_k, v_k, B_k, C_k, gy_k, v_r, B_r, gy_r, gv_r, gB_r, gC_r, gdt_k = chunks[k]
        torch.mul(dt_k, At2, out=a_head).exp2_()
        a_fwd.copy_(a_head)                                              # cheaper than exp2 again
        _states(hs, start, prefix, slots[k], v_k, B_k)
        # dL/dh_t = C_t gy_t + a_{t+1} dL/dh_{t+1}, entering with G at the chunk's last step.
        torch.mul(C_k, gy_k, out=gh)
        gh_end.add_(G)
        _run(suffix)
        torch.mul(a0, gh0, out=G)                                        # dL/dh at the chunk's start
        torch.bmm(gy_r, hs_rt, out=gC_r)                                 # Σ_d h gy
        torch.bmm(v_r, gh_rt, out=gB_r)                                  # Σ_d gh Δx
        torch.bmm(B_r, gh_r, out=gv_r)                                   # Σ_n B gh
        # dL/da_t for the log-decay a_t = Δ_t A: dL/dh_t ⊙ exp(a_t) h_{t-1} = dL/dh_t ⊙ (h_t - u_t).
        # The states are not needed any more, so it overwrites them.
        ga = hs.addcmul_(v_k, B_k, value=-1.0).mul_(gh)
        torch.sum(torch.mul(ga, At, out=gh), 2, out=gdt_k)              # Σ_n dL/da ⊙ A
        gA_steps.addcmul_(ga, dt_k)
    gAt = gA_steps.sum((0, 1))                                           # (N, D)
    gdt_c.addcmul_(gv_c, x_c)                                            # Δ also scales the input
    gx_c = gv_c.mul_(dt_c)
    grads = (*(_unchunked(t, T) for t in (gx_c, gdt_c)), gAt.t(), *(_unchunked(t, T) for t in (gB_c, gC_c)),
             G.transpose(1, 2))
    _POOL.give(flat)
    return grads


def _states(hs, start, prefix, h, v, B) -> None:
    """A chunk's states into ``hs`` (Bt, L, N, D), from the state h (Bt, N, D) before it. The decays
    a_t = exp(Δ_t A) must be in the buffer the prefix rounds overwrite; ``start`` is (hs[:, 0], a[:, 0])."""
    torch.mul(v, B, out=hs)                                                  # u_t = Δ_t x_t B_t
    start[0].addcmul_(start[1], h)                                           # the carried state enters
    _run(prefix)
