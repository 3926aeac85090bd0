"""The Mamba scan's chunk length: forward + backward time per chunk size, and how close ``auto`` gets.

For each shape (batch rows, sequence length, d_inner; d_state 16) the selective scan of
``lmlab_mamba.scan`` runs forward and backward on random inputs with chunks of 4 to 64 steps, taking
turns so machine noise hits every chunk size alike. Printed: the median milliseconds per chunk size,
the length :func:`auto_chunk_size` picks, and its time over the best one's (1.00 = it picked the best).

    python bench/mamba_chunks.py [--rounds 15] [--threads 1] [--shape 12x64x256 ...]

Shorter chunks mean fewer prefix rounds (passes over the states) but more chunks, each paying every
op's fixed overhead again; the best length keeps a chunk's states about the size of the CPU's caches,
so it shrinks as the batch or d_inner grows.
"""

import argparse
import statistics
import time

import torch

from lmlab_mamba.scan import auto_chunk_size, selective_scan

SHAPES = ["12x64x256", "4x64x256", "32x64x256", "3x256x256", "1x1024x256", "12x64x512", "2x256x512"]
LENGTHS = [4, 8, 16, 32, 64]


def scan_step(rows: int, steps: int, d_inner: int, d_state: int = 16):
    """A function running one forward and backward pass of the scan with a given chunk length."""
    generator = torch.Generator().manual_seed(0)
    x, dt = (torch.randn(rows, steps, d_inner, generator=generator) for _ in range(2))
    dt = (0.1 * dt.abs()).requires_grad_()
    x.requires_grad_()
    A = (-2 * torch.rand(d_inner, d_state, generator=generator)).requires_grad_()
    B, C = (torch.randn(rows, steps, d_state, generator=generator).requires_grad_() for _ in range(2))
    gy = torch.randn(rows, steps, d_inner, generator=generator)

    def run(length: int) -> None:
        y, _ = selective_scan(x, dt, A, B, C, chunk_size=length)
        y.backward(gy)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15, help="timed turns per chunk length")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--shape", action="append", default=None, metavar="ROWSxSTEPSxD_INNER",
                        help=f"shapes to time (default: {' '.join(SHAPES)})")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"threads {torch.get_num_threads()} | {args.rounds} turns of 3 scans per chunk length | d_state 16")
    print(f"{'rows x steps x d_inner':>22s}  " + "  ".join(f"{f'L={n}':>7s}" for n in LENGTHS) + "   auto  auto/best")
    for shape in args.shape or SHAPES:
        rows, steps, d_inner = (int(v) for v in shape.split("x"))
        run = scan_step(rows, steps, d_inner)
        lengths = [n for n in LENGTHS if n <= steps]
        times: dict[int, list[float]] = {n: [] for n in lengths}
        for n in lengths:
            run(n)  # warm-up: the buffer pool fills
        for _ in range(args.rounds):
            for n in lengths:
                start = time.perf_counter()
                for _ in range(3):
                    run(n)
                times[n].append((time.perf_counter() - start) / 3)
        median = {n: statistics.median(t) for n, t in times.items()}
        auto = min(auto_chunk_size(rows, d_inner, 16, torch.device("cpu")), steps)
        cells = "  ".join(f"{median[n] * 1e3:7.2f}" if n in median else f"{'':7s}" for n in LENGTHS)
        print(f"{shape:>22s}  {cells}   {auto:4d}  {median[auto] / min(median.values()):9.2f}")


if __name__ == "__main__":
    main()
