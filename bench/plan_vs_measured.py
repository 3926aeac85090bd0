"""`lmlab plan`'s per-device memory estimate against the peak measured while training, per strategy.

Trains a model big enough for the estimate to matter (8 layers, d_model 768: 57 M parameters, 0.9 GB
of fp32 AdamW model states, about as much again of activations) for a few steps with each parallel
strategy whose plugin is installed (single, ddp on 2 processes, fsdp and deepspeed ZeRO-2/3 when
present), through `lmlab run`'s own code path, one thread per process, and prints the estimate, the
measured peak per process and their ratio.

Measured as `lmlab.testing.memory` measures (the conformance check that tests/test_plan.py runs on
a smaller model): each process's peak resident set growth during training, the largest over them.

    python bench/plan_vs_measured.py [--steps 3] [--layers 8] [--d-model 768] [--batch 4] [--block 256]
        [--only single,ddp]
"""

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_BUCKETS = "reduce_bucket_size = 20_000_000\nallgather_bucket_size = 20_000_000"

#: name → [parallel] table (2 processes for the distributed ones) and [train] additions.
STRATEGIES = {
    "single": ('use = "single"\naccelerator = "cpu"', ""),
    "single-bf16-mixed": ('use = "single"\naccelerator = "cpu"', 'precision = "bf16-mixed"'),
    "single-checkpointing-ffn": ('use = "single"\naccelerator = "cpu"', 'checkpointing = "ffn"'),
    "ddp": ('use = "ddp"\ndevices = 2\naccelerator = "cpu"', ""),
    "fsdp": ('use = "fsdp"\ndevices = 2\naccelerator = "cpu"', ""),
    "fsdp-no-reshard": ('use = "fsdp"\ndevices = 2\naccelerator = "cpu"\nreshard_after_forward = false', ""),
    # Reduction buckets smaller than the model, as on a real one: a CPU process's resident set counts
    # only the pages of DeepSpeed's (2 × 2·10⁸-element by default) buckets that are ever written.
    "deepspeed-zero2": (f'use = "deepspeed"\ndevices = 2\naccelerator = "cpu"\nstage = 2\n{_BUCKETS}', ""),
    "deepspeed-zero3": (f'use = "deepspeed"\ndevices = 2\naccelerator = "cpu"\nstage = 3\n{_BUCKETS}', ""),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--only", default=None, help="comma-separated strategy names")
    args = parser.parse_args()

    from lmlab import discovery
    from lmlab.testing.memory import measure_plan

    installed = {info.name for info in discovery.installed().get("parallel", [])}
    chosen = args.only.split(",") if args.only else list(STRATEGIES)
    os.environ.setdefault("LMLAB_CACHE", tempfile.mkdtemp(prefix="lmcache-plan-bench-"))
    with tempfile.TemporaryDirectory(prefix="plan-bench-") as tmp:
        data = Path(tmp) / "corpus.txt"
        data.write_text((ROOT / "data" / "tinyshakespeare.txt").read_text()[:100_000])
        rows, params = [], None
        for i, name in enumerate(chosen):
            parallel, train_extra = STRATEGIES[name]
            plugin = parallel.split('"')[1]
            if plugin not in installed:
                print(f"{name}: skipped, parallel plugin {plugin!r} is not installed", file=sys.stderr)
                continue
            try:
                m = measure_plan(parallel, Path(tmp) / f"s{i}", train_extra=train_extra, layers=args.layers,
                                 d_model=args.d_model, heads=args.heads, block=args.block, batch=args.batch,
                                 steps=args.steps, corpus=data)
            except AssertionError as exc:
                print(f"{name}: {exc}", file=sys.stderr)
                continue
            params = m.params
            rows.append((name, m))
            print(f"{name}: estimate {m.estimate / 1e6:.0f} MB, measured {m.measured / 1e6:.0f} MB", file=sys.stderr)
    print(f"{args.layers} layers, d_model {args.d_model}, micro-batch {args.batch} × {args.block}, "
          f"{(params or 0) / 1e6:.1f} M parameters, AdamW, {args.steps} steps, CPU")
    print(f"| {'strategy':<26} | processes | estimate MB | measured MB | estimate / measured |")
    print(f"| {'-' * 26} | ---: | ---: | ---: | ---: |")
    for name, m in rows:
        print(f"| {name:<26} | {m.devices} | {m.estimate / 1e6:,.0f} | {m.measured / 1e6:,.0f} | {m.ratio:.2f} |")


if __name__ == "__main__":
    main()
