"""Would storing a pruned weight sparse make it faster here? One linear layer of a 50 %-sparse weight
(unstructured, the zeros `wanda` leaves) timed dense, as a CSR tensor and as a COO tensor, at one token
(a decode step) and at 512 tokens (a prefill), in float32 on this CPU; ratios are against dense,
measured interleaved in the same run. Also the bytes each form holds.

    python bench/sparse_linear.py [--in-features 1024] [--out-features 4096] [--rounds 7]
"""

import argparse
import statistics
import time
import warnings

import torch


def timed(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def nbytes(t: torch.Tensor) -> int:
    if t.layout == torch.sparse_csr:
        return sum(p.numel() * p.element_size() for p in (t.crow_indices(), t.col_indices(), t.values()))
    if t.layout == torch.sparse_coo:
        return sum(p.numel() * p.element_size() for p in (t.indices(), t.values()))
    return t.numel() * t.element_size()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--in-features", type=int, default=1024)
    parser.add_argument("--out-features", type=int, default=4096)
    parser.add_argument("--sparsity", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
    torch.manual_seed(0)
    weight = torch.randn(args.out_features, args.in_features)
    weight[torch.rand_like(weight) < args.sparsity] = 0
    forms = {"dense": weight, "csr": weight.to_sparse_csr(), "coo": weight.to_sparse_coo()}
    print(f"threads {torch.get_num_threads()}, weight {args.out_features}x{args.in_features}, "
          f"{float((weight == 0).float().mean()):.2f} zeros")
    print("form    bytes      ratio")
    for name, w in forms.items():
        print(f"{name:6} {nbytes(w):>10,} {nbytes(w) / nbytes(weight):6.2f}")
    for tokens in (1, 512):
        xt = torch.randn(tokens, args.in_features).t()
        reference = torch.mm(weight, xt)
        for w in forms.values():
            torch.testing.assert_close(torch.mm(w, xt), reference, rtol=1e-4, atol=1e-3)
        repeats = 200 if tokens == 1 else 10
        times = {name: [] for name in forms}
        for _ in range(args.rounds):  # interleaved: each round times every form once
            for name, w in forms.items():
                times[name].append(timed(lambda: torch.mm(w, xt), repeats))  # noqa: B023 - called at once
        dense = statistics.median(times["dense"])
        print(f"\n{tokens} token(s): form  ms/call  × dense time")
        for name in forms:
            t = statistics.median(times[name])
            print(f"  {name:6} {t * 1e3:8.3f}  {t / dense:6.2f}")


if __name__ == "__main__":
    main()
