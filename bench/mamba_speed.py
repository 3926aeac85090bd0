"""Training throughput of the ``mamba`` mixer against softmax attention, same run.

Two models of the quickstart shape (experiments/shakespeare-char.toml: 4 layers, d_model 128, block 64,
batch 12), built by lmlab's own model builder from the manifest: ``mha`` with learned positions, and
``mamba`` with position ``none`` (same mlp feed-forward, norms and head). Each trains with AdamW on the
same batches (forward, backward, clip, step); they alternate in windows of ``--every`` steps so machine
noise hits both alike, and the first window of each is left out (warm-up). Printed: the median time per
step of each, tokens/s, and the ratio mamba / mha (target ≥ 0.5 on a 2-core CPU).

    python bench/mamba_speed.py [--windows 10] [--every 10] [--threads 1] [--set attention.chunk_size=8 ...]
                                [--both model.block_size=256 --both train.batch_size=3 ...]

``--both`` changes every model alike: a longer context at the same tokens per step shows how the
ratio moves with sequence length (attention's cost per token grows with it, the scan's does not).
"""

import argparse

import torch

from stepper import ModelStepper, interleaved_medians

VARIANTS = {"mha": ["attention.use=mha", "position.use=learned"],
            "mamba": ["attention.use=mamba", "position.use=none"],
            # The original Mamba architecture: mixer-only blocks, no MLP (ffn none).
            "mamba-only": ["attention.use=mamba", "position.use=none", "ffn.use=none"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=10, help="timed windows per model (after one warm-up)")
    parser.add_argument("--every", type=int, default=10, help="steps per window")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE",
                        help="extra override for the mamba model, e.g. attention.chunk_size=4")
    parser.add_argument("--both", action="append", default=[], metavar="KEY=VALUE",
                        help="override for every model, e.g. model.block_size=256")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    steppers = {name: ModelStepper(args.both + overrides + (args.overrides if name != "mha" else []))
                for name, overrides in VARIANTS.items()}
    median = interleaved_medians(steppers, args.windows, args.every, warmup=args.every)
    tokens = steppers["mha"].B * steppers["mha"].T
    print(f"threads {torch.get_num_threads()} | {args.windows} interleaved windows of {args.every} steps | "
          f"batch {steppers['mha'].B} x block {steppers['mha'].T}")
    for name, seconds in median.items():
        print(f"{name:6s} {steppers[name].params:9,d} params  {seconds * 1e3:7.2f} ms/step  "
              f"{tokens / seconds:9,.0f} tokens/s")
    print(f"ratio mamba / mha tokens/s = {median['mha'] / median['mamba']:.3f}  (target >= 0.5; same blocks, "
          f"mixer swapped)")
    print(f"ratio mamba-only / mha tokens/s = {median['mha'] / median['mamba-only']:.3f}  (mixer-only blocks, "
          f"{steppers['mamba-only'].params:,d} params)")


if __name__ == "__main__":
    main()
