"""Decoding against the memory-bandwidth bound: each weight format's batch-1 tokens/s as a fraction of
what this machine's memory allows.

A batch-1 decode step reads every weight the step uses once (each linear layer, the head; of the
embedding only one row, unless the head shares it), so ``bandwidth / bytes read per token`` bounds
its tokens/s. The bandwidth is measured here, in the same run: the median rate of summing a 512 MiB
float32 tensor (a read-only stream, as a decode step's weights are; the 2 threads torch uses).
Each format of RUN_DIR is then decoded greedily at batch 1 (a 16-token prompt from its validation
text, ``--new`` tokens, the median of ``--rounds`` after a warm-up) and printed with its bytes per
token, its bound and the fraction of it reached, and beside them the rate of the step's matmuls
alone for the dense formats (every linear layer applied once to one token's activations, nothing
else: what the kernels allow before any framework cost):

- ``fp32``: the run as trained; ``bf16``: the same weights cast to bfloat16 (where the CPU has the
  instructions for bfloat16 matmuls, else it is listed as slow);
- every other format is ``lmlab compress --use NAME`` of the run into a scratch folder, loaded back
  as ``lmlab generate`` loads it. Its bytes are every tensor the loaded model holds, so a method that
  keeps two copies of a weight (``rtn``: its portable codes and the CPU kernel's packed layout, of
  which a step reads one) is counted with both, and its fraction of the bound is overstated.

    python bench/decode_bound.py RUN_DIR [--formats fp32,bf16,int8,rtn] [--new 64] [--rounds 3]
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def read_bandwidth(mib: int = 512, repeats: int = 9) -> float:
    """Bytes per second this process reads from memory (sum of a float32 tensor beyond the caches)."""
    x = torch.ones(mib * 2 ** 20 // 4)
    x.sum()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - start)
    return x.numel() * 4 / statistics.median(times)


def bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of the weights one decode step reads: every parameter and buffer once (shared storage
    counted once), less the embedding table when the head does not read it too (a step reads one row)."""
    seen, total = set(), 0
    for tensor in [*model.parameters(), *model.buffers()]:
        key = tensor.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += tensor.untyped_storage().nbytes()
    embedding = getattr(model, "tok_emb", None)
    head = getattr(model, "head", None)
    if isinstance(embedding, torch.nn.Embedding) and getattr(head, "weight", None) is not embedding.weight:
        total -= embedding.weight.untyped_storage().nbytes() - embedding.weight[0].nbytes
    return total


def tokens_per_s(run, prompt: str, new: int, rounds: int) -> float:
    from lmlab import discovery
    from lmlab.generation.batch import generate_texts

    decoder = discovery.load("decoding", "greedy")()
    generate_texts(run.model, run.tokenizer, decoder, [prompt], 8)  # warm-up: first-call costs
    rates = [generate_texts(run.model, run.tokenizer, decoder, [prompt], new).tokens_per_s for _ in range(rounds)]
    return statistics.median(rates)


def matmuls_only(model: torch.nn.Module, repeats: int = 5) -> float:
    """Tokens/s if a step were only its linear layers, each applied to one token (batch 1)."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if not linears:
        return float("nan")
    dtype = linears[0].weight.dtype
    inputs = [torch.randn(1, 1, m.in_features, dtype=dtype) for m in linears]
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            start = time.perf_counter()
            for m, x in zip(linears, inputs):
                m(x)
            times.append(time.perf_counter() - start)
    return 1 / statistics.median(times[1:])


def bf16_matmul_is_native() -> bool:
    return torch.backends.cpu.get_cpu_capability() in ("AVX512", "AMX") and "bf16" in open("/proc/cpuinfo").read()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--formats", default="fp32,bf16,int8,rtn")
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from lmlab.compress.command import compress
    from lmlab.compress.methods import resolve
    from lmlab.trained import load_run

    bandwidth = read_bandwidth()
    print(f"read bandwidth {bandwidth / 1e9:.2f} GB/s (sum of 512 MiB, {torch.get_num_threads()} threads); "
          f"bfloat16 matmuls native: {bf16_matmul_is_native()}")
    base = load_run(args.run_dir)
    prompt = "The capital of France is"
    print("| format | MB read per token | bound tokens/s | tokens/s | fraction of bound | × fp32 | matmuls alone, tokens/s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    fp32 = None
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.formats.split(","):
            if name == "fp32":
                run = base
            elif name == "bf16":
                run = load_run(args.run_dir)
                run.model.to(torch.bfloat16)
            else:
                out = Path(scratch) / name
                compress(args.run_dir.resolve(), resolve([name], [], Path.cwd()), out, log=lambda *_: None)
                run = load_run(out)
            size = bytes_per_token(run.model)
            bound = bandwidth / size
            rate = tokens_per_s(run, prompt, args.new, args.rounds)
            fp32 = fp32 or rate
            # Dense formats only: a compressed run's layers are its method's modules, not nn.Linear.
            kernels = f"{matmuls_only(run.model):,.1f}" if name in ("fp32", "bf16") else "-"
            print(f"| {name} | {size / 1e6:,.1f} | {bound:,.1f} | {rate:,.1f} | {rate / bound:.2f} | {rate / fp32:.2f} "
                  f"| {kernels} |", flush=True)
            print(f"done: {name}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
