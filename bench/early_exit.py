"""Early exit's quality/speed trade-off on a run trained with exit heads (``architecture.exit_layers``).

For each threshold (``architecture.exit_threshold``; 1.0 never exits, so it is the full model through
the same engine) over one run, e.g. ``lmlab run experiments/early_exit.toml``:

- **exit (decode)**: the average exit layer (blocks run per token; the full model's is n_layers) of
  greedy decoding, ``--prompts`` prompts of the corpus one at a time, ``--new`` tokens each;
- **val ppl**: teacher-forced perplexity of the validation split's text (the corpus's last 10 %, as
  ``val_fraction`` cuts it), in windows of the model's block_size, each token scored with the logits
  of the head it exits at and the states early exit leaves behind (``copy``: CALM's propagated exit
  states, what ``lmlab generate`` does; ``exact``: the deferred blocks read the previous block's
  output, as the full model would) -- and **exit (val)**, its average exit layer;
- **tokens/s**: greedy decoding speed over the same prompts (median over ``--rounds`` rounds, every
  prompt decoded by every arm in turn), and its **speed-up** against threshold 1.0 measured in the
  same run;
- **same tokens**: the share of greedy tokens equal, position by position, to the full model's, and
  **prefix**: the mean length of the continuation before the first difference.

The full model through the engine (the greedy plugin's own path, ``lmlab generate`` without a
threshold) is measured beside them, so the early-exit loop's own overhead shows.

    python bench/early_exit.py RUN_DIR [--new 200] [--prompts 8] [--rounds 3] [--windows 24] [--threads 1]
                               [--thresholds 1.0 0.99 0.95 0.9 0.8 0.6]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
THRESHOLDS = (1.0, 0.99, 0.95, 0.9, 0.8, 0.6)


@torch.inference_mode()
def decode(run, threshold: float | None, prompt: str, new: int):
    """One prompt alone, greedy: (seconds, its new tokens, the sum of their exit layers or None)."""
    from lmlab import discovery
    from lmlab.generation.engine import make_engine
    from lmlab.generation.outputs import Outputs
    from lmlab.generation.token_ids import run_decoder
    from lmlab_architectures.early_exit import EarlyExitEngine

    ids = list(run.tokenizer.encode(prompt))
    run.model.eval()
    started = time.perf_counter()
    engine = make_engine(run.model, 1, len(ids) + new) if threshold is None else \
        EarlyExitEngine(run.model, 1, len(ids) + new, threshold)
    outputs = Outputs(run.tokenizer, [new], eos_id=run.tokenizer.eos_id)
    for _ in run_decoder(discovery.load("decoding", "greedy")(), engine, [ids], outputs):
        pass
    seconds = time.perf_counter() - started
    return seconds, outputs.completions[0].tokens, (engine.stats.layers if threshold is not None else None)


@torch.inference_mode()
def perplexity(model, ids: list[int], block: int, windows: int, threshold: float, propagate: str):
    """Teacher-forced perplexity and average exit layer over ``windows`` windows of ``block`` tokens."""
    from lmlab_architectures.early_exit import teacher_forced

    nll, layers = [], []
    for w in range(windows):
        scores, exits = teacher_forced(model, ids[w * block:(w + 1) * block], threshold, propagate)
        nll.append(scores)
        layers += exits
    return torch.cat(nll).mean().exp().item(), sum(layers) / len(layers)


def agreement(tokens: list[list[int]], full: list[list[int]]) -> tuple[float, float]:
    same = total = prefix = 0
    for a, b in zip(tokens, full):
        same += sum(x == y for x, y in zip(a, b))
        total += len(b)
        prefix += next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return same / total, prefix / len(full)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a run trained with architecture.exit_layers")
    parser.add_argument("--new", type=int, default=200, help="greedy tokens per prompt")
    parser.add_argument("--prompts", type=int, default=8, help="prompts of the corpus, 24 characters each")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (median)")
    parser.add_argument("--windows", type=int, default=24, help="validation windows of block_size tokens")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (batch-1 decoding: 1 is fastest here)")
    parser.add_argument("--thresholds", type=float, nargs="+", default=list(THRESHOLDS),
                        help="exit thresholds; 1.0 (the baseline of the speed-ups) is always added")
    args = parser.parse_args(argv)
    thresholds = sorted({1.0, *args.thresholds}, reverse=True)
    torch.set_num_threads(args.threads)

    from lmlab.trained import load_run

    run = load_run(args.run_dir)
    model = run.model
    if not getattr(model, "exit_layers", ()):
        raise SystemExit(f"{args.run_dir} was trained without architecture.exit_layers")
    n = len(model.blocks)
    block = model.shape.block_size
    text = (ROOT / "data" / "tinyshakespeare.txt").read_text()
    val = list(run.tokenizer.encode(text[int(len(text) * 0.9):]))
    windows = min(args.windows, len(val) // block)
    prompts = [text[i:i + 24] for i in range(1000, 1000 + args.prompts * 5000, 5000)]
    print(f"early exit: {args.run_dir} ({n} blocks, exits after blocks {list(model.exit_layers)}); greedy, "
          f"{len(prompts)} prompts one at a time, {args.new} new tokens each, {args.threads} thread(s); "
          f"val: {windows} windows of {block} tokens")

    # Quality first (deterministic), then speed in interleaved rounds.
    quality = {t: {p: perplexity(model, val, block, windows, t, p) for p in ("copy", "exact")} for t in thresholds}
    arms = {"engine": None, **{t: t for t in thresholds}}
    decode(run, None, prompts[0], 8)  # warm up
    decode(run, 0.9, prompts[0], 8)
    # Interleaved prompt by prompt, so that every arm meets the machine's drift alike.
    rates = {arm: [] for arm in arms}
    tokens = {arm: [] for arm in arms}
    layers = {arm: 0 for arm in arms}
    for r in range(args.rounds):
        seconds = {arm: 0.0 for arm in arms}
        made = {arm: 0 for arm in arms}
        for prompt in prompts:
            for arm, threshold in arms.items():
                spent, new, layer_sum = decode(run, threshold, prompt, args.new)
                seconds[arm] += spent
                made[arm] += len(new)
                if r == 0:
                    tokens[arm].append(new)
                    layers[arm] += layer_sum or 0
        for arm in arms:
            rates[arm].append(made[arm] / seconds[arm])
    rate = {arm: statistics.median(r) for arm, r in rates.items()}
    full = tokens["engine"]
    if tokens[1.0] != full:
        raise SystemExit("threshold 1.0 differs from the full model's greedy tokens")
    exit_decode = {t: layers[t] / sum(map(len, tokens[t])) for t in thresholds}

    print(f"\n| threshold | exit (decode) | exit (val) | val ppl (copy) | val ppl (exact) | tokens/s | speed-up | "
          f"same tokens | prefix |")
    print("|---|---|---|---|---|---|---|---|---|")
    for t in thresholds:
        (ppl, exit_val), (ppl_exact, _) = quality[t]["copy"], quality[t]["exact"]
        same, prefix = agreement(tokens[t], full)
        print(f"| {t:g} | {exit_decode[t]:.2f} / {n} | {exit_val:.2f} | {ppl:.3f} | {ppl_exact:.3f} | "
              f"{rate[t]:,.0f} | {rate[t] / rate[1.0]:.2f} | {same:.0%} | {prefix:.0f} / {args.new} |")
    print(f"\nthe full model through the engine (greedy, no threshold): {rate['engine']:,.0f} tokens/s; "
          f"the early-exit loop at 1.0 / engine = {rate[1.0] / rate['engine']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
