"""Training throughput: lmlab (the Lightning path) against a hand-written PyTorch loop, same run.

Both train nanoGPT's baby GPT (experiments/shakespeare-char.toml) on the same tokens. They are
interleaved finely: every K lmlab steps, a hook pauses lmlab and runs K steps of the plain loop, so
machine noise (frequency scaling, neighbours) hits both alike. The first steps of each are left
out (warm-up). Printed: the median time per step of each and the ratio of tokens/s, lmlab / plain
(target ≥ 1.0).

``--processes``: the comparison a user makes, each tool a separate process. Each round runs lmlab
(``lmlab run``) and the hand-written script (``bench/handwritten_train.py``) for ``--long`` steps,
alternating which goes first. Each process times its own steps (lmlab's ``elapsed_s`` in
``metrics.jsonl`` every 10 steps, the script's clock every step); a least-squares line through those
(step, seconds) points after the first ``--skip`` steps gives its steady-state seconds per step, free
of start-up and exit (which ``bench/startup.py`` measures). A round's ratio is hand-written / lmlab
(lmlab's relative tokens/s); it varies from process to process on a shared machine, so at least ten
rounds are run. Printed: the median ratio with a 95 % bootstrap confidence interval (10,000
resamples of the rounds), and a verdict only when the interval excludes the target (1.0).

    python bench/train_speed.py [--steps 1000] [--every 20] [--warmup 100]
    python bench/train_speed.py --processes [--rounds 10] [--long 300] [--skip 50]
"""

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import whole_process  # noqa: E402
from handwritten_train import PlainLoop  # noqa: E402

from lmlab import manifest  # noqa: E402
from lmlab.api import hookimpl  # noqa: E402
from lmlab.assemble import assemble  # noqa: E402
from lmlab.train.runner import run_variant  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


class Interleave:
    """A hook that times lmlab's steps between pauses, and the plain loop's steps in the pauses."""

    def __init__(self, plain: PlainLoop, every: int, warmup: int):
        self.plain, self.every, self.warmup = plain, every, warmup
        self.lmlab_s: list[float] = []
        self.plain_s: list[float] = []
        self.mark = None

    @hookimpl
    def lmlab_train_batch_end(self, step):
        if step < self.warmup or step % self.every:
            return None
        now = time.perf_counter()
        if self.mark is not None:
            self.lmlab_s.append((now - self.mark) / self.every)
        else:
            self.plain.steps(self.warmup)  # warm the plain loop up too
        start = time.perf_counter()
        self.plain.steps(self.every)
        self.plain_s.append((time.perf_counter() - start) / self.every)
        self.mark = time.perf_counter()
        return None


def in_process(steps: int, every: int, warmup: int, same_model: bool = False) -> tuple[float, float, int]:
    """(lmlab's median s/step, the plain loop's, windows) interleaved in this process."""
    # Evaluation and checkpoints only at the end: this measures the training step.
    overrides = ["tracker.use=none", "train.sample_tokens=0", f"train.max_steps={steps}",
                 f"train.eval_every={steps}", "train.eval_steps=1", f"train.checkpoint_every={steps}"]
    (variant,) = manifest.load(ROOT / "experiments" / "shakespeare-char.toml", overrides)
    built = assemble(variant, data=True)
    data = built.tokens
    model = built.model if same_model else None
    plain = PlainLoop(data.train, data.tokenizer.vocab_size, variant.manifest, steps, model)
    probe = Interleave(plain, every, warmup)
    with tempfile.TemporaryDirectory() as tmp:
        run_variant(variant, Path(tmp) / "run", extra_hooks=[probe])
    return statistics.median(probe.lmlab_s), statistics.median(probe.plain_s), len(probe.lmlab_s)


def slope(clock: list[tuple[int, float]], skip: int) -> float:
    """Seconds per step: the least-squares slope of a process's (step, seconds) after step ``skip``."""
    points = [(n, t) for n, t in clock if n > skip]
    if len(points) < 3:
        raise SystemExit(f"only {len(points)} timed steps after step {skip}: run more steps")
    return statistics.linear_regression([n for n, _ in points], [t for _, t in points]).slope


def processes(rounds: int, long: int, skip: int) -> list[float]:
    """Each round's ratio of steady-state step costs, hand-written / lmlab."""
    ratios = []
    for r in range(rounds):
        # lmlab logs (and so syncs the loss) every 10 steps, as the hand-written loop does.
        tools = [("lmlab", lambda n: whole_process.lmlab(n, log_every=10)), ("handwritten", whole_process.handwritten)]
        if r % 2:
            tools.reverse()
        per_step = {name: slope(run(long).clock, skip) for name, run in tools}
        ratios.append(per_step["handwritten"] / per_step["lmlab"])
        print(f"  round {r + 1:2d}: lmlab {per_step['lmlab'] * 1e3:6.2f} ms/step, hand-written "
              f"{per_step['handwritten'] * 1e3:6.2f} ms/step, ratio {ratios[-1]:.3f}", flush=True)
    return ratios


def median_interval(values: list[float], resamples: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """A 95 % percentile-bootstrap confidence interval for the median of ``values``."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def verdict(ratios: list[float], target: float = 1.0) -> str:
    low, high = median_interval(ratios)
    if low > target:
        word = f"lmlab is faster than {target} of the hand-written script's speed"
    elif high < target:
        word = f"lmlab is below {target} of the hand-written script's speed"
    else:
        word = f"inconclusive at {target}"
    return (f"median {statistics.median(ratios):.3f}, 95 % interval {low:.3f}-{high:.3f} over {len(ratios)} "
            f"rounds: {word}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", action="store_true", help="whole processes, alternating rounds")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--long", type=int, default=300, help="--processes: steps of each process")
    parser.add_argument("--skip", type=int, default=50, help="--processes: steps left out of the slope (warm-up)")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--same-model", action="store_true",
                        help="run the plain loop on lmlab's own model: isolates the training path's overhead")
    args = parser.parse_args()
    if args.processes:
        if args.rounds < 10:
            parser.error("--processes needs at least 10 rounds: fewer prove nothing either way")
        print(f"whole processes: {args.rounds} rounds of {args.long} steps each, slope after step {args.skip}")
        ratios = processes(args.rounds, args.long, args.skip)
        print(f"ratio lmlab / hand-written tokens/s, whole processes: {verdict(ratios)}")
        lm, pl, windows = in_process(400, args.every, 100)
        print(f"in one process (interleaved, {windows} windows of {args.every} steps): {pl / lm:.3f}")
        return
    lm, pl, windows = in_process(args.steps, args.every, args.warmup, args.same_model)
    tokens = 12 * 64  # the quickstart's batch_size × block_size
    print(f"threads {torch.get_num_threads()} | {windows} interleaved windows of {args.every} steps")
    print(f"plain loop  {pl * 1e3:6.2f} ms/step  {tokens / pl:9,.0f} tokens/s")
    print(f"lmlab       {lm * 1e3:6.2f} ms/step  {tokens / lm:9,.0f} tokens/s")
    print(f"ratio lmlab / plain tokens/s = {pl / lm:.3f}  (target >= 1.0)")


if __name__ == "__main__":
    main()
