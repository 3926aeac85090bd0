"""Step time of the quickstart with the everyday monitors (grad-norm, loss-spike, nan-guard,
throughput) against without them, interleaved in one training run.

One process trains the quickstart model; every ``--block`` optimizer steps the monitors are
registered with the run's hook manager or taken off it, so both arms share the process, the data, the
allocator's state and the machine's load. Without them no ``lmlab_before_optimizer_step`` hook is
implemented, so the core computes no gradient norm either: the "off" arm is the plain loop. Printed
are the median step times of each arm (the first block and the steps that evaluate or checkpoint left
out) and the ratio on / off; the target is below 1.03.

    python bench/monitor_overhead.py [--steps 1200] [--block 20] [--threads N]
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MONITORS = ["grad-norm", "loss-spike", "nan-guard", "throughput"]


class Interleave:
    """Times every optimizer step and switches the monitors on and off every ``block`` steps."""

    def __init__(self, block: int):
        self.block = block
        self.last = None
        self.times = {True: [], False: []}
        self.monitors = None  # the monitor instances, found on the first step
        self.on = True

    def lmlab_train_batch_end(self, step, control):
        now = time.perf_counter()
        hooks = control.module.hooks
        if self.monitors is None:
            self.monitors = [p for p in hooks.manager.get_plugins() if type(p).__module__.startswith("lmlab_monitors")]
        if self.last is not None and step > self.block:  # the first block warms up
            self.times[self.on].append(now - self.last)
        if step % self.block == 0:
            self.on = not self.on
            for plugin in self.monitors:
                if self.on:
                    hooks.register(plugin)
                else:
                    hooks.manager.unregister(plugin)
            hooks._implemented = None  # which hooks are implemented is cached; recompute
        self.last = time.perf_counter()  # the switch itself is nobody's step time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--block", type=int, default=20, help="steps per arm before switching")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()

    from lmlab import manifest
    from lmlab.api import hookimpl
    from lmlab.train.runner import run_variant

    Interleave.lmlab_train_batch_end = hookimpl(Interleave.lmlab_train_batch_end)
    overrides = [f"train.max_steps={args.steps}", f"train.eval_every={args.steps}",
                 f"train.checkpoint_every={args.steps}", "train.sample_tokens=0", "tracker.use=none",
                 f"monitor.use={MONITORS!r}".replace("'", '"')]
    if args.threads:
        overrides.append(f"train.threads={args.threads}")
    (variant,) = manifest.load(ROOT / "experiments" / "shakespeare-char.toml", overrides)
    probe = Interleave(args.block)
    with tempfile.TemporaryDirectory() as tmp:
        run_variant(variant, Path(tmp) / "run", extra_hooks=[probe])
    on, off = (statistics.median(probe.times[arm]) * 1e3 for arm in (True, False))
    print(f"quickstart model, {args.steps} steps in blocks of {args.block}, monitors {', '.join(MONITORS)}")
    print(f"on  {on:7.3f} ms/step (median of {len(probe.times[True])} steps)")
    print(f"off {off:7.3f} ms/step (median of {len(probe.times[False])} steps)")
    print(f"ratio on/off {on / off:.4f} (target < 1.03)")


if __name__ == "__main__":
    sys.exit(main())
