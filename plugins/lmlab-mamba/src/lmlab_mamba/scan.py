"""Mamba's selective scan in plain PyTorch: chunked and parallel for training, one step for decoding.

The recurrence, for each batch row, channel d and state index n (Gu & Dao 2023, eq. 2, with the
zero-order hold for A and the Euler step for B of the reference implementation)::

    h_t = exp(Δ_t A) ⊙ h_{t-1} + (Δ_t x_t) B_t        h: (N, D) here, (D, N) in the state object
    y_t = C_t · h_t                                    y: (D,)

Training runs it chunk by chunk. Inside a chunk of L steps every state comes at once from cumulative
sums of the log-decays ``a_t = Δ_t A ≤ 0``: with ``S_t = a_1 + ... + a_t`` and a reference r,

    h_t = exp(S_t - r) ⊙ (exp(r) h_0 + Σ_{s≤t} exp(r - S_s) ⊙ u_s)        u_s = (Δ_s x_s) B_s

the factorised scan in log space of Heinsen 2023 ("Efficient Parallelization of a Ubiquitous
Sequential Computation"), applied to one chunk. Only each chunk's last state is carried to the next,
in a loop over T / L chunks, never over time steps. Three things make it fast on a CPU: A does not
depend on time, so ``S_t = A ⊙ Σ_{s≤t} Δ_s`` needs cumulative sums of Δ only, N times less work;
the cumulative sums are products with a triangular (L, L) matrix, many times faster than ``cumsum``
along a middle axis; and the backward pass is written out (the adjoint of a linear recurrence is the
same recurrence run backwards), so it costs about what the forward does. Exponentials are base 2
(``exp2`` is several times faster than ``exp`` in PyTorch's CPU kernels).

Numerics, all in float32: exponents are taken against the chunk's middle step (r = S_mid) and come
straight from segment sums (never a difference of two long sums), and no exponent may exceed
``MAX_EXPONENT`` = 70 in size. A chunk where the decay Δ · |A| on either side of the middle is at most
that — nearly every chunk: Δ ≈ 0.001..0.1 and |A| ≤ d_state at init — is exact up to rounding. A
chunk beyond it is cut into
pieces of at most 8 steps, and in a piece that still exceeds it each step's log-decay is floored at
``-2 · MAX_EXPONENT / 8`` = -17.5, so that the at most 4 steps on either side of the middle stay in
range. A floored step keeps a fraction e^-17.5 ≈ 2.5e-8 of the previous state where the exact one keeps
even less: a difference below float32's resolution of that state.
"""

import math

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

#: Largest |S_t - S_mid|: e^70 ≈ 2.5e30 leaves float32 (max ≈ 3.4e38) room for the sums it multiplies.
MAX_EXPONENT = 70.0
#: A chunk with too much decay is cut into pieces this long, so that their per-step floor is -17.5 or lower.
FLOORED_CHUNK = 8
LOG2_E = 1.0 / math.log(2.0)


def selective_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   h0: torch.Tensor | None = None, chunk_size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence above over T steps, in chunks of ``chunk_size``. Time-major, so that a chunk is a
    contiguous block of rows and its cumulative sums are one (l, l) @ (l, Bt·N·D) matrix product.

    x, dt (T, Bt, D); A (D, N) ≤ 0; B, C (T, Bt, N); h0 (Bt, D, N) or None for zeros; all float32.
    Returns y (T, Bt, D) and the last state h_T (Bt, D, N).
    """
    if h0 is None:
        h0 = x.new_zeros(x.shape[1], A.shape[0], A.shape[1])
    backward = torch.is_grad_enabled() and any(t.requires_grad for t in (x, dt, A, B, C, h0))
    with torch.autocast(x.device.type, enabled=False):  # mixed precision must not reach the scan
        return _ChunkedScan.apply(x, dt, A, B, C, h0, chunk_size, backward)


def selective_step(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One recurrent step (decoding): x, dt (Bt, D); B, C (Bt, N); h (Bt, D, N) → y (Bt, D), new h."""
    h = torch.exp(dt[..., None] * A) * h + (dt * x)[..., None] * B[:, None, :]  # (Bt, D, N)
    return (h * C[:, None, :]).sum(-1), h  # elementwise, so mixed precision (autocast) leaves it in float32


class _Chunks:
    """The chunks of one scan: bounds, cumulative-sum matrices and decays, shared by both passes.

    Chunks are ``chunk_size`` long, except that one whose decay exceeds ``MAX_EXPONENT`` on a side of its
    middle is cut into pieces of at most ``FLOORED_CHUNK`` steps, which are floored if they still do.
    """

    def __init__(self, dt: torch.Tensor, At2: torch.Tensor, chunk_size: int):
        T = dt.shape[0]
        self.L = min(chunk_size, T)
        rate = dt * (At2.abs().amax(0) / LOG2_E)          # (T, Bt, D) each step's decay at its channel's fastest
        bounds = _split(0, T, self.L)
        if self.L > FLOORED_CHUNK:
            bounds = [piece for bound, big in zip(bounds, self._too_much_decay(rate, bounds))
                      for piece in (_split(*bound, FLOORED_CHUNK) if big else [bound])]
        self.bounds = bounds
        self.floored = self._too_much_decay(rate, bounds)
        self.matrices = {}

    @staticmethod
    def _too_much_decay(rate: torch.Tensor, bounds: list[tuple[int, int]]) -> list[bool]:
        """Per chunk: does the decay on either side of its middle step exceed MAX_EXPONENT anywhere?"""
        flags = [False] * len(bounds)
        by_length: dict[int, list[int]] = {}
        for i, (start, end) in enumerate(bounds):
            by_length.setdefault(end - start, []).append(i)
        for l, chunks in by_length.items():  # one gather per chunk length (two at most, without floors)
            starts = torch.tensor([bounds[i][0] for i in chunks], device=rate.device)
            steps = rate[(starts[:, None] + torch.arange(l, device=rate.device)).flatten()]
            steps = steps.view(len(chunks), l, -1)                                # (chunks, l, Bt·D)
            mid = (l - 1) // 2
            # S_0 - S_mid sums steps 1..mid; S_{l-1} - S_mid sums steps mid+1..l-1.
            side = torch.maximum(steps[:, 1:mid + 1].sum(1), steps[:, mid + 1:].sum(1)).amax(1)
            for i, big in zip(chunks, (side > MAX_EXPONENT).tolist()):
                flags[i] = big
        return flags

    def floor(self, l: int) -> float:
        """Per-step floor of the log2-decays in a floored chunk of l steps: each side of the middle holds
        at most l/2 steps, so its exponents stay within MAX_EXPONENT."""
        return -2 * MAX_EXPONENT / l * LOG2_E

    def matrices_for(self, l: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(tril, seg) for a chunk of l steps: ``tril @ z`` sums z over steps ≤ t; ``seg @ z`` (l+1 rows)
        sums it from the middle step to t (signed) in rows 0..l-1 and up to the middle in row l."""
        if l not in self.matrices:
            tril = torch.ones(l, l, device=like.device, dtype=like.dtype).tril()
            mid = (l - 1) // 2
            self.matrices[l] = tril, torch.cat([tril - tril[mid], tril[mid:mid + 1]])  # (l, l), (l+1, l)
        return self.matrices[l]

    def decays(self, k: int, dt_c: torch.Tensor, At2: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Chunk k's exp(S_t - S_mid) into ``out`` (l, Bt, N, D); returns exp(S_mid) (Bt, N, D)."""
        l = dt_c.shape[0]
        _, seg = self.matrices_for(l, dt_c)
        if not self.floored[k]:
            # a_t = Δ_t A, so S_t - S_mid = A ⊙ (Δ summed from the middle to t): sums over (l, Bt, D) only.
            s = (seg @ dt_c.flatten(1)).view(l + 1, *dt_c.shape[1:])        # (l+1, Bt, D)
            torch.mul(s[:l, :, None, :], At2, out=out).exp2_()
            return torch.exp2(s[l, :, None, :] * At2)
        a = (dt_c[:, :, None, :] * At2).clamp_(min=self.floor(l))            # (l, Bt, N, D) log2-decays
        S = (seg @ a.flatten(1)).view(l + 1, *a.shape[1:])                   # (l+1, Bt, N, D)
        torch.exp2(S[:l], out=out)
        return torch.exp2(S[l])


def _split(start: int, end: int, size: int) -> list[tuple[int, int]]:
    return [(s, min(s + size, end)) for s in range(start, end, size)]


class _BufferPool:
    """Large flat buffers handed back after use and taken again by the next scan of the same size.

    A CPU allocator returns big blocks to the operating system when they are freed, and touching fresh
    pages costs more than the scan's arithmetic: reusing the buffers made a training step of the
    quickstart model markedly faster. Buffers in use belong to their scan alone; the pool keeps only
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


class _ChunkedScan(torch.autograd.Function):
    """Forward and backward of :func:`selective_scan`. Inside, everything is time-major and states are
    (l, Bt, N, D) with channels last, so y = C · h and the gradients are wide products or reductions.
    All large temporaries come from :data:`_POOL`."""

    @staticmethod
    def forward(ctx, x, dt, A, B, C, h0, chunk_size, training):
        x, dt, B, C = (t.contiguous() for t in (x, dt, B, C))              # (T, Bt, ·)
        At2 = A.t().contiguous() * LOG2_E                                    # (N, D) A in base-2 units
        T, Bt, D = x.shape
        N = At2.shape[0]
        chunks = _Chunks(dt, At2, chunk_size)
        # Every state h_t and decay exp(S_t - S_mid), kept for the backward pass; without one, a chunk's
        # worth of each is enough.
        saved = [_POOL.take((T if training else chunks.L) * Bt * N * D, x) for _ in range(2)]
        work = [_POOL.take(chunks.L * Bt * N * D, x) for _ in range(2)]
        v = dt * x                                                           # (T, Bt, D)
        y = torch.empty_like(x)
        h = h0.transpose(1, 2)                                               # (Bt, N, D)
        for k, (start, end) in enumerate(chunks.bounds):
            l = end - start
            tril, _ = chunks.matrices_for(l, x)
            offset = start * Bt * N * D if training else 0
            hs, P = (buf[offset:offset + l * Bt * N * D].view(l, Bt, N, D) for buf in saved)
            u, inflow = (buf[:hs.numel()].view_as(hs) for buf in work)
            e_mid = chunks.decays(k, dt[start:end], At2, out=P)             # P = exp(S_t - S_mid)
            torch.mul(v[start:end, :, None, :], B[start:end, :, :, None], out=u).div_(P)  # u_t exp(S_mid - S_t)
            torch.mm(tril, u.view(l, -1), out=inflow.view(l, -1))             # Σ_{s≤t} exp(S_mid - S_s) u_s
            torch.add(inflow, e_mid * h, out=hs).mul_(P)                     # (l, Bt, N, D) states h_t
            torch.matmul(C[start:end, :, None, :], hs, out=y[start:end, :, None, :])  # (l, Bt, 1, D)
            h = hs[-1] if training else hs[-1].clone()  # the buffer is overwritten by the next chunk
        _POOL.give(*work)
        if training:
            ctx.save_for_backward(x, dt, At2, B, C)
            ctx.chunks, ctx.saved = chunks, saved
        else:
            _POOL.give(*saved)
        return y, h.transpose(1, 2).clone()  # not a view of the pooled buffer, which will be reused

    @staticmethod
    @once_differentiable
    def backward(ctx, gy, gh_last):
        with torch.autocast(gy.device.type if gy is not None else gh_last.device.type, enabled=False):
            return _ChunkedScan._backward(ctx, gy, gh_last)

    @staticmethod
    def _backward(ctx, gy, gh_last):
        if ctx.saved is None:
            raise RuntimeError("the mamba scan frees its saved states after one backward pass; "
                               "backward through it twice (retain_graph) is not supported")
        x, dt, At2, B, C = ctx.saved_tensors
        chunks = ctx.chunks
        T, Bt, D = x.shape
        N = At2.shape[0]
        states, decays = (buf.view(T, Bt, N, D) for buf in ctx.saved)
        v = dt * x
        gy = torch.zeros_like(x) if gy is None else gy.contiguous()         # (T, Bt, D)
        # G: dL/dh at the end of the chunk being processed, walking backwards from the last one.
        G = x.new_zeros(Bt, N, D) if gh_last is None else gh_last.transpose(1, 2)
        gv, gdt, gB, gC = torch.empty_like(x), torch.empty_like(x), torch.empty_like(B), torch.empty_like(C)
        gAt = torch.zeros_like(At2)                                          # dL/dA, transposed: (N, D)
        work = [_POOL.take(chunks.L * Bt * N * D, x) for _ in range(2)]
        for k in reversed(range(len(chunks.bounds))):
            start, end = chunks.bounds[k]
            l = end - start
            tril, _ = chunks.matrices_for(l, x)
            hs, P = states[start:end], decays[start:end]                     # (l, Bt, N, D)
            w, gh = (buf[:hs.numel()].view_as(hs) for buf in work)
            gy_c, v_c, B_c, dt_c = gy[start:end, :, None, :], v[start:end, :, None, :], B[start:end], dt[start:end]
            # dL/dh_t = Σ_{s≥t} exp(S_s - S_t) (C_s ⊗ gy_s) + exp(S_l - S_t) G: a reverse cumulative sum.
            torch.mul(C[start:end, :, :, None], gy_c, out=w).mul_(P)         # (l, Bt, N, D)
            torch.mm(tril.t(), w.view(l, -1), out=gh.view(l, -1))
            gh.add_(P[-1] * G).div_(P)
            torch.sum(torch.mul(hs, gy_c, out=w), -1, out=gC[start:end])       # (l, Bt, N)
            torch.sum(torch.mul(gh, v_c, out=w), -1, out=gB[start:end])        # (l, Bt, N)
            torch.matmul(B_c[:, :, None, :], gh, out=gv[start:end, :, None, :])  # (l, Bt, 1, D)
            a0 = dt_c[0, :, None, :] * At2                                   # (Bt, N, D) first step, base 2
            if chunks.floored[k]:
                a0 = a0.clamp(min=chunks.floor(l))
            G = gh[0] * torch.exp2(a0)                                       # dL/dh at the chunk's start
            # dL/da_t = dL/dh_t ⊙ exp(a_t) h_{t-1}, and exp(a_t) h_{t-1} = h_t - u_t (a in natural units).
            ga = torch.addcmul(hs, v_c, B_c[..., None], value=-1.0, out=w).mul_(gh)
            if chunks.floored[k]:
                ga.masked_fill_(dt_c[:, :, None, :] * At2 < chunks.floor(l), 0.0)  # a floored step: no gradient
            torch.sum(torch.mul(ga, At2, out=gh), 2, out=gdt[start:end])
            gAt += torch.mul(ga, dt_c[:, :, None, :], out=gh).sum((0, 1))
        _POOL.give(*ctx.saved, *work)
        ctx.saved = None
        # ga is dL/da for the natural log-decay a = Δ A; the Σ ga · At2 above used A · log2(e).
        gdt.div_(LOG2_E).add_(gv * x)
        return gv * dt, gdt, gAt.t(), gB, gC, G.transpose(1, 2), None, None
