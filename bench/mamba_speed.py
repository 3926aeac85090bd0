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

``--budget`` adds two measuring devices (not models anyone should train), built like ``mamba``:
``no-scan`` swaps the selective scan for the cheapest stand-in that keeps the graph (y = Δ·x, one
elementwise product), so 2 × mha − no-scan is what the scans of all layers may cost together for the
ratio to reach 0.5; ``no-recurrence`` runs the scan with its recurrence rounds skipped (wrong states,
the same work otherwise: decays, inputs, contractions, gradients and copies), which shows what the scan
costs even if its recurrence were free. Both are printed per layer next to what the real scan costs.
"""

import argparse

import torch

import lmlab_mamba.inner
import lmlab_mamba.mamba
import lmlab_mamba.scan
from stepper import ModelStepper, interleaved_medians

VARIANTS = {"mha": ["attention.use=mha", "position.use=learned"],
            "mamba": ["attention.use=mamba", "position.use=none"],
            # The original Mamba architecture: mixer-only blocks, no MLP (ffn none).
            "mamba-only": ["attention.use=mamba", "position.use=none", "ffn.use=none"]}


class PatchedStepper(ModelStepper):
    """A model that steps with attributes of modules swapped (a measuring device, not a model)."""

    def __init__(self, overrides: list[str], patches: list[tuple[object, str, object]]):
        super().__init__(overrides)
        self.patches = patches

    def steps(self, n: int) -> float:
        real = [getattr(module, name) for module, name, _ in self.patches]
        for module, name, stand_in in self.patches:
            setattr(module, name, stand_in)
        try:
            return super().steps(n)
        finally:
            for (module, name, _), original in zip(self.patches, real):
                setattr(module, name, original)


# The scan as y = Δ·x, in both of the mixer's paths: op by op (selective_scan) and fused (lmlab_mamba.inner).
def _no_scan(x, dt, A, B, C, h0=None, chunk_size=None):
    return x * dt, x.new_zeros(x.shape[0], A.shape[0], A.shape[1])


def _no_scan_forward(x, dt, A, B, C, h0, chunk_size, training):
    return x * dt, None, None


def _no_scan_backward(x, dt, A, B, C, kept, gy, gh_last):
    return gy * dt, gy * x, torch.zeros_like(A), B.new_zeros(B.shape), C.new_zeros(C.shape), None


NO_SCAN = [(lmlab_mamba.mamba, "selective_scan", _no_scan), (lmlab_mamba.inner, "scan_forward", _no_scan_forward),
           (lmlab_mamba.inner, "scan_backward", _no_scan_backward)]


def _no_rounds(rounds) -> None:
    pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=10, help="timed windows per model (after one warm-up)")
    parser.add_argument("--every", type=int, default=10, help="steps per window")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE",
                        help="extra override for the mamba model, e.g. attention.chunk_size=4")
    parser.add_argument("--both", action="append", default=[], metavar="KEY=VALUE",
                        help="override for every model, e.g. model.block_size=256")
    parser.add_argument("--budget", action="store_true",
                        help="also time the mamba model without its scan and without its recurrence, and print the "
                             "scan's budget for 0.5")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    steppers = {name: ModelStepper(args.both + overrides + (args.overrides if name != "mha" else []))
                for name, overrides in VARIANTS.items()}
    if args.budget:
        mamba = args.both + VARIANTS["mamba"] + args.overrides
        steppers["no-scan"] = PatchedStepper(mamba, NO_SCAN)
        steppers["no-recurrence"] = PatchedStepper(mamba, [(lmlab_mamba.scan, "_run", _no_rounds)])
    median = interleaved_medians(steppers, args.windows, args.every, warmup=args.every)
    tokens = steppers["mha"].B * steppers["mha"].T
    print(f"threads {torch.get_num_threads()} | {args.windows} interleaved windows of {args.every} steps | "
          f"batch {steppers['mha'].B} x block {steppers['mha'].T}")
    for name, seconds in median.items():
        print(f"{name:13s} {steppers[name].params:9,d} params  {seconds * 1e3:7.2f} ms/step  "
              f"{tokens / seconds:9,.0f} tokens/s")
    print(f"ratio mamba / mha tokens/s = {median['mha'] / median['mamba']:.3f}  (target >= 0.5; same blocks, "
          f"mixer swapped)")
    print(f"ratio mamba-only / mha tokens/s = {median['mha'] / median['mamba-only']:.3f}  (mixer-only blocks, "
          f"{steppers['mamba-only'].params:,d} params)")

    if args.budget:
        layers = sum(isinstance(m, lmlab_mamba.mamba.MambaMixer) for m in steppers["mamba"].model.modules())
        allowed = (2 * median["mha"] - median["no-scan"]) / layers
        spent = (median["mamba"] - median["no-scan"]) / layers
        free = (median["no-recurrence"] - median["no-scan"]) / layers
        print(f"ratio no-scan / mha tokens/s = {median['mha'] / median['no-scan']:.3f}  (the mamba step without "
              f"its scan)")
        print(f"ratio no-recurrence / mha tokens/s = {median['mha'] / median['no-recurrence']:.3f}  (the mamba "
              f"step if the scan's recurrence cost nothing)")
        print(f"scan budget for 0.5: {allowed * 1e3:.2f} ms per layer (forward + backward); the scan takes "
              f"{spent * 1e3:.2f} ms per layer in the real step, {free * 1e3:.2f} ms without its recurrence "
              f"(budget / scan = {allowed / spent:.2f}, budget / scan without recurrence = {allowed / free:.2f})")


if __name__ == "__main__":
    main()
