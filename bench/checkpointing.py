"""Activation checkpointing policies: peak memory and step time of each, against `none`.

Trains a model big enough for activations to dominate (d_model 256, 6 layers, block 256, batch 16
by default) for a few steps under each `[train] checkpointing` policy. Each policy runs in its own
process so peak memory is its own: on CUDA the allocator's peak, on the CPU the peak resident set.
Also printed: the bytes autograd saved for backward in one step (what checkpointing trades away).

    python bench/checkpointing.py [--steps 6] [--d-model 256] [--layers 6] [--block 256] [--batch 16]
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
POLICIES = ("none", "attention", "ffn", "full")


def measure(args) -> dict:
    import torch
    from torch.nn import functional as F

    from lmlab import manifest
    from lmlab.assemble import assemble

    overrides = ["tracker.use=none", f"model.d_model={args.d_model}", f"model.n_layers={args.layers}",
                 f"model.block_size={args.block}", "model.n_heads=8", "model.vocab_size=256"]
    (variant,) = manifest.load(ROOT / "experiments" / "shakespeare-char.toml", overrides)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    built = assemble(variant)
    model = built.model.to(device)
    model.set_checkpointing(args.policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 256, (args.batch, args.block + 1), device=device)

    saved = 0

    def pack(t):
        nonlocal saved
        saved += t.numel() * t.element_size()
        return t

    times = []
    for step in range(args.steps):
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if step == 0 else _null():
            logits = model(x[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = (torch.cuda.max_memory_allocated() / 2**20 if device == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    return {"policy": args.policy, "step_s": statistics.median(times[1:]), "peak_mb": peak,
            "saved_mb": saved / 2**20, "device": device}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--policy", help=argparse.SUPPRESS)  # set in the per-policy subprocess
    args = parser.parse_args()
    if args.policy:
        print(json.dumps(measure(args)))
        return
    rows = []
    for policy in POLICIES:
        cmd = [sys.executable, __file__, "--policy", policy, *sys.argv[1:]]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, env={**os.environ}).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    base = rows[0]
    print(f"d_model {args.d_model}, {args.layers} layers, block {args.block}, batch {args.batch}, "
          f"device {base['device']}")
    print(f"{'policy':<10} {'step s':>8} {'x none':>7} {'peak MB':>9} {'x none':>7} {'saved MB':>9} {'x none':>7}")
    for r in rows:
        print(f"{r['policy']:<10} {r['step_s']:8.3f} {r['step_s'] / base['step_s']:7.2f} {r['peak_mb']:9.0f} "
              f"{r['peak_mb'] / base['peak_mb']:7.2f} {r['saved_mb']:9.0f} {r['saved_mb'] / base['saved_mb']:7.2f}")


if __name__ == "__main__":
    main()
