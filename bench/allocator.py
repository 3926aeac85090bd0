"""Training step time and page faults with glibc's default malloc thresholds vs lmlab's (lmlab.train.allocator).

The setting is process-wide, so each measurement is a fresh process: the quickstart model (and its
Mamba variant) steps ``--steps`` times after a warm-up, reporting ms/step and minor page faults per
step. Processes alternate between the two settings, ``--rounds`` each; printed are the medians and the
ratio tuned / default (below 1 = faster).

    python bench/allocator.py [--rounds 3] [--steps 40] [--variant mha --variant mamba]
"""

import argparse
import json
import resource
import statistics
import subprocess
import sys

VARIANTS = {"mha": ["attention.use=mha", "position.use=learned"],
            "mamba": ["attention.use=mamba", "position.use=none"]}


def child(tuned: bool, variant: str, steps: int) -> None:
    from lmlab.train.allocator import tune_for_training
    from stepper import ModelStepper

    setting = tune_for_training() if tuned else None
    stepper = ModelStepper(VARIANTS[variant], tune_malloc=False)
    stepper.steps(steps // 2)  # warm-up: the first steps allocate everything once
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    seconds = stepper.steps(steps)
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / steps
    print(json.dumps({"ms": seconds * 1e3, "faults": faults, "setting": setting}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="processes per setting and variant")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per process")
    parser.add_argument("--variant", action="append", choices=sorted(VARIANTS), default=None)
    parser.add_argument("--verbose", action="store_true", help="print every process's time")
    parser.add_argument("--child", nargs=2, metavar=("SETTING", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child[0] == "tuned", args.child[1], args.steps)
    variants = args.variant or list(VARIANTS)
    results: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.rounds):
        for variant in variants:
            for setting in ("default", "tuned"):
                command = [sys.executable, __file__, "--child", setting, variant, "--steps", str(args.steps)]
                out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
                results.setdefault((variant, setting), []).append(json.loads(out.splitlines()[-1]))
    if args.verbose:
        for key, runs in results.items():
            print(*key, " ".join(f"{r['ms']:.1f}" for r in runs))
    print(f"{args.rounds} processes per setting, {args.steps} steps each (after {args.steps // 2} warm-up)")
    for variant in variants:
        ms = {s: statistics.median(r["ms"] for r in results[variant, s]) for s in ("default", "tuned")}
        faults = {s: statistics.median(r["faults"] for r in results[variant, s]) for s in ("default", "tuned")}
        print(f"{variant:6s} default {ms['default']:7.2f} ms/step {faults['default']:7.0f} faults/step | tuned "
              f"{ms['tuned']:7.2f} ms/step {faults['tuned']:7.0f} faults/step | tuned / default = "
              f"{ms['tuned'] / ms['default']:.3f}")
    print(f"tuned: {results[variants[0], 'tuned'][0]['setting']}")


if __name__ == "__main__":
    main()
