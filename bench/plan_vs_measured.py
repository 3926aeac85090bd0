"""`lmlab plan`'s per-device memory estimate against the peak measured while training, per strategy.

Trains a model big enough for the estimate to matter (8 layers, d_model 768: 57 M parameters, 0.9 GB
of fp32 AdamW model states, about as much again of activations) for a few steps with each parallel
strategy whose plugin is installed (single, ddp on 2 processes, fsdp and deepspeed ZeRO-2/3 when
present), through `lmlab run`'s own code path, one thread per process, and prints the estimate, the
measured peak per process and their ratio.

Measured: the process's peak resident set (ru_maxrss, read after the last training step, before any
checkpoint is written) minus its resident set just before the run started building the model (after
torch and Lightning were imported), the largest over the processes. glibc's malloc is told to serve
every allocation above 128 kB with its own mmap (MALLOC_MMAP_THRESHOLD_, which also stops glibc
raising that threshold as it does by default), so memory torch frees goes back to the system at once
and the resident set follows live tensors instead of the allocator's high-water marks.

    python bench/plan_vs_measured.py [--steps 3] [--layers 8] [--d-model 768] [--batch 4] [--block 256]
        [--only single,ddp]
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

from lmlab.api import hookimpl

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

MANIFEST = """
name = "plan-vs-measured"
seed = 1

[data]
use = "text-file"
path = "{data}"

[model]
n_layers = {layers}
d_model = {d_model}
n_heads = {heads}
block_size = {block}

[train]
max_steps = {steps}
batch_size = {batch}
eval_batch_size = 2
eval_every = 1000
eval_steps = 1
checkpoint_every = 1000
log_every = 1
warmup_steps = 1
sample_tokens = 0
threads = 1
{train_extra}

[parallel]
{parallel}

[tracker]
use = "none"
"""


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakProbe:
    """Writes this process's peak resident set after every training step (the last one wins)."""

    def __init__(self, out: Path, baseline: int):
        self.out, self.baseline = out, baseline

    @hookimpl
    def lmlab_train_batch_end(self, step, loss, model, log):
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
        (self.out / f"rank{rank}.json").write_text(json.dumps({"baseline": self.baseline, "peak": peak}))


def worker(manifest_path: Path, out: Path) -> None:
    """One training process (Lightning re-runs this command for the other ranks)."""
    import lightning  # noqa: F401 — imported before the baseline: not the model's memory
    import torch  # noqa: F401

    from lmlab import manifest
    from lmlab.train import module, recorder, runner  # noqa: F401

    (variant,) = manifest.load(manifest_path)
    probe = PeakProbe(out, rss_bytes())
    runner.run_variant(variant, out / "run", extra_hooks=[probe])


def measure(manifest_path: Path, workdir: Path) -> float:
    out = workdir / "measured"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}
    result = subprocess.run([sys.executable, __file__, "--worker", str(manifest_path), str(out)],
                            capture_output=True, text=True, env=env, timeout=3600)
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-3000:])
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    return max(r["peak"] - r["baseline"] for r in ranks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--only", default=None, help="comma-separated strategy names")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(Path(args.worker[0]), Path(args.worker[1]))
        return

    from lmlab import discovery, manifest
    from lmlab.plan import plan_variant

    installed = {info.name for info in discovery.installed().get("parallel", [])}
    chosen = args.only.split(",") if args.only else list(STRATEGIES)
    os.environ.setdefault("LMLAB_CACHE", tempfile.mkdtemp(prefix="lmcache-plan-bench-"))
    with tempfile.TemporaryDirectory(prefix="plan-bench-") as tmp:
        data = Path(tmp) / "corpus.txt"
        data.write_text((ROOT / "data" / "tinyshakespeare.txt").read_text()[:100_000])
        rows = []
        for i, name in enumerate(chosen):
            parallel, train_extra = STRATEGIES[name]
            plugin = parallel.split('"')[1]
            if plugin not in installed:
                print(f"{name}: skipped, parallel plugin {plugin!r} is not installed", file=sys.stderr)
                continue
            workdir = Path(tmp) / f"s{i}"
            workdir.mkdir()
            path = workdir / "manifest.toml"
            path.write_text(MANIFEST.format(data=data, layers=args.layers, d_model=args.d_model, heads=args.heads,
                                            block=args.block, steps=args.steps, batch=args.batch,
                                            parallel=parallel, train_extra=train_extra))
            (variant,) = manifest.load(path)
            plan = plan_variant(variant)
            try:
                measured = measure(path, workdir)
            except RuntimeError as exc:
                print(f"{name}: training failed:\n{exc}", file=sys.stderr)
                continue
            rows.append((name, plan.device.layout.devices, plan.device.total, measured))
            print(f"{name}: estimate {plan.device.total / 1e6:.0f} MB, measured {measured / 1e6:.0f} MB",
                  file=sys.stderr)
    print(f"{args.layers} layers, d_model {args.d_model}, micro-batch {args.batch} × {args.block}, "
          f"{plan.facts.params / 1e6:.1f} M parameters, AdamW, {args.steps} steps, CPU")
    print(f"| {'strategy':<26} | processes | estimate MB | measured MB | estimate / measured |")
    print(f"| {'-' * 26} | ---: | ---: | ---: | ---: |")
    for name, devices, estimate, measured in rows:
        print(f"| {name:<26} | {devices} | {estimate / 1e6:,.0f} | {measured / 1e6:,.0f} | {estimate / measured:.2f} |")


if __name__ == "__main__":
    main()
