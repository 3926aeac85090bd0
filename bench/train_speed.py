"""Training throughput: lmlab (the Lightning path) against a hand-written PyTorch loop, same run.

Both train nanoGPT's baby GPT (experiments/shakespeare-char.toml) on the same tokens. They are
interleaved finely: every K lmlab steps, a hook pauses lmlab and runs K steps of the plain loop, so
machine noise (frequency scaling, neighbours) hits both alike. The first steps of each are left
out (warm-up). Printed: the median time per step of each and the ratio of tokens/s, lmlab / plain
(target ≥ 0.95).

``--processes``: the comparison a user makes, each tool a separate process. Each round runs lmlab
(``lmlab run``) and the hand-written script (``bench/handwritten_train.py``) for ``--short`` and for
``--long`` steps, alternating which goes first; the marginal cost of a step is wall(long) −
wall(short) over the extra steps, which cancels start-up and the end of the run. The ratio of
each round (hand-written marginal / lmlab marginal: lmlab's relative tokens/s) varies from process
to process on a shared machine (one process's steps are 42 ms, the next one's 66 ms), so at least
ten rounds are run; printed are their median and interquartile range, a verdict only when that
range excludes 0.95 ("inconclusive" otherwise), and the in-process figure beside them.

    python bench/train_speed.py [--steps 1000] [--every 20] [--warmup 100]
    python bench/train_speed.py --processes [--rounds 10] [--short 50] [--long 250]
"""

import argparse
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


def processes(rounds: int, short: int, long: int) -> list[float]:
    """Each round's ratio of marginal step costs, hand-written / lmlab."""
    ratios = []
    for r in range(rounds):
        # lmlab logs (and so syncs the loss) every 10 steps, as the hand-written loop does.
        tools = [("lmlab", lambda n: whole_process.lmlab(n, log_every=10)), ("handwritten", whole_process.handwritten)]
        if r % 2:
            tools.reverse()
        marginal = {}
        for name, run in tools:
            walls = {n: run(n).wall for n in (short, long)}
            marginal[name] = (walls[long] - walls[short]) / (long - short)
        ratios.append(marginal["handwritten"] / marginal["lmlab"])
        print(f"  round {r + 1:2d}: lmlab {marginal['lmlab'] * 1e3:6.2f} ms/step, hand-written "
              f"{marginal['handwritten'] * 1e3:6.2f} ms/step, ratio {ratios[-1]:.3f}", flush=True)
    return ratios


def verdict(ratios: list[float], target: float = 0.95) -> str:
    q1, median, q3 = statistics.quantiles(ratios, n=4)
    if q1 > target:
        word = f"lmlab is at least {target} of the hand-written script's speed"
    elif q3 < target:
        word = f"lmlab is below {target} of the hand-written script's speed"
    else:
        word = "inconclusive"
    return f"median {median:.3f}, interquartile range {q1:.3f}-{q3:.3f} over {len(ratios)} rounds: {word}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", action="store_true", help="whole processes, alternating rounds")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--short", type=int, default=50)
    parser.add_argument("--long", type=int, default=250)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--same-model", action="store_true",
                        help="run the plain loop on lmlab's own model: isolates the training path's overhead")
    args = parser.parse_args()
    if args.processes:
        if args.rounds < 10:
            parser.error("--processes needs at least 10 rounds: fewer prove nothing either way")
        print(f"whole processes: {args.rounds} rounds of {args.short} and {args.long} steps each")
        ratios = processes(args.rounds, args.short, args.long)
        print(f"ratio lmlab / hand-written tokens/s, whole processes: {verdict(ratios)}")
        lm, pl, windows = in_process(400, args.every, 100)
        print(f"in one process (interleaved, {windows} windows of {args.every} steps): {pl / lm:.3f}")
        return
    lm, pl, windows = in_process(args.steps, args.every, args.warmup, args.same_model)
    tokens = 12 * 64  # the quickstart's batch_size × block_size
    print(f"threads {torch.get_num_threads()} | {windows} interleaved windows of {args.every} steps")
    print(f"plain loop  {pl * 1e3:6.2f} ms/step  {tokens / pl:9,.0f} tokens/s")
    print(f"lmlab       {lm * 1e3:6.2f} ms/step  {tokens / lm:9,.0f} tokens/s")
    print(f"ratio lmlab / plain tokens/s = {pl / lm:.3f}  (target >= 0.95)")


if __name__ == "__main__":
    main()
