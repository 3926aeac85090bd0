"""Decoder-only vs encoder-decoder at equal size on the Shakespeare instruction task, measured.

Runs experiments/architectures-pretrain.toml (a 4 x 128 GPT with causal-lm, and a 2 + 2 x 116
encoder-decoder with span-corruption, three seeds each; finished runs are not trained again), then
experiments/architectures.toml (sft from each pretrained run), then scores every fine-tuned run on the
held-out instruction records (data/shakespeare-sft/heldout.jsonl.gz) with `lmlab eval`: greedy answers,
exact match. Prints one row per architecture (mean ± sd over seeds, and each seed) with the parameter
count, the fine-tune's held-out answer loss (cross-entropy of the answer tokens given the prompt, which
both architectures are scored on alike) and the training throughput.

    python bench/architectures.py [--limit N]

The runs go to runs/ at the repository root, where the fine-tune manifest's [init] tables look for them.
"""

import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXPERIMENTS = ROOT / "experiments"
RUNS = ROOT / "runs"
RECORDS = ROOT / "data" / "shakespeare-sft" / "heldout.jsonl.gz"


def lmlab(*args: str) -> str:
    print("$ lmlab " + " ".join(args), flush=True)
    done = subprocess.run([sys.executable, "-m", "lmlab", *args], check=True, capture_output=True, text=True)
    return done.stdout


def exact_match(run: Path, limit: int | None) -> float:
    printed = lmlab("eval", str(run), "--data", str(RECORDS), *(["--limit", str(limit)] if limit else []))
    return float(re.search(r"exact match ([0-9.]+)", printed).group(1))


def spread(values: list[float], digits: int = 3) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.{digits}f} ± {sd:.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--limit", type=int, help="score only the first N held-out records")
    args = parser.parse_args()
    for name in ("architectures-pretrain", "architectures"):
        lmlab("run", str(EXPERIMENTS / f"{name}.toml"))
    rows: dict[str, list[dict]] = {}
    for run in sorted(p for p in (RUNS / "architectures").iterdir() if p.is_dir()):
        summary = json.loads((run / "summary.json").read_text())
        kind = "encoder-decoder" if "encoder-decoder" in run.name else "decoder"
        rows.setdefault(kind, []).append({"seed": summary["seed"] if "seed" in summary else run.name[-1],
                                          "params": summary["params"], "val_loss": summary["val_loss"],
                                          "tokens_per_s": summary["tokens_per_s"],
                                          "exact_match": exact_match(run, args.limit)})
    print()
    print("| architecture | params | answer loss (held-out) | exact match | per seed | tokens/s |")
    print("| --- | ---: | ---: | ---: | --- | ---: |")
    for kind, found in rows.items():
        found.sort(key=lambda r: str(r["seed"]))
        per_seed = ", ".join(f"{r['exact_match']:.3f}" for r in found)
        print(f"| {kind} | {found[0]['params']:,} | {spread([r['val_loss'] for r in found])} | "
              f"{spread([r['exact_match'] for r in found])} | {per_seed} | "
              f"{statistics.mean(r['tokens_per_s'] for r in found):,.0f} |")


if __name__ == "__main__":
    main()
