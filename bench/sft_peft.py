"""Fine-tuning methods compared on the Shakespeare instruction task: one table per method.

Runs ``experiments/sft-pretrain.toml`` (the 10.7 M-parameter base model; skipped when its run is
complete, as any finished variant is), then the ``experiments/sft-peft.toml`` sweep (full fine-tune,
LoRA r=8 on q/v, bottleneck adapter, IA3, QLoRA, each at its own learning rate), then ``lmlab eval`` of
each variant, and of the base model itself with the sweep's prompt template, on the held-out records.
Printed per method: trainable parameters (and their share), optimizer-state memory, the adapter file's
size, peak memory, the median step time, held-out exact match overall and per task, and the ratio of
each method's exact match to full fine-tuning's with a 95 % interval from a paired bootstrap over the
held-out records (the issue's target for LoRA: at least 0.9, with under 2 % of the parameters trained).
Step times come from each run's own tokens/s: they compare only runs that had the machine alike.

    python bench/sft_peft.py [--runs runs] [--pretrained RUN] [--limit N] [--set train.max_steps=300 ...]

Everything goes through the CLI, as a user would run it; the runs stay in ``--runs`` so that the
table can be printed again (finished runs are not trained again).
"""

import argparse
import gzip
import hashlib
import json
import subprocess
import sys
import tomllib
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
HELD_OUT = ROOT / "data" / "shakespeare-sft" / "heldout.jsonl.gz"
SFT_PEFT = ROOT / "experiments" / "sft-peft.toml"
BOOTSTRAP = 2000


def lmlab(*args: str) -> None:
    print("$ lmlab " + " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", "lmlab", *args], check=True)


def tasks(limit: int | None) -> list[str]:
    with gzip.open(HELD_OUT, "rt") as f:
        rows = [json.loads(line)["task"] for line in f]
    return rows[:limit] if limit else rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, default=ROOT / "runs", help="where the runs go")
    parser.add_argument("--pretrained", type=Path, default=None,
                        help="an existing run to fine-tune from (default: run experiments/sft-pretrain.toml)")
    parser.add_argument("--limit", type=int, default=None, help="evaluate only the first N held-out records")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override the fine-tuning manifest")
    args = parser.parse_args()
    sft = args.runs / "sft-peft"
    base = args.pretrained
    if base is None:
        lmlab("run", str(ROOT / "experiments" / "sft-pretrain.toml"), "--out", str(args.runs / "sft-pretrain"))
        base = args.runs / "sft-pretrain" / "default"
    sets = [f"init.from={json.dumps(str(base.resolve()))}"] + args.overrides
    lmlab("run", str(SFT_PEFT), "--out", str(sft), *(x for s in sets for x in ("--set", s)))
    order = json.loads((sft / "sweep.json").read_text())["variants"]
    kinds = tasks(args.limit)
    # The base model before any fine-tuning, prompted with the sweep's own template: what the
    # instruction format alone gets out of it.
    data = tomllib.loads(SFT_PEFT.read_text())["data"]
    base_sets = [f"data.{k}={json.dumps(v)}" for k, v in data.items() if k not in ("path", "replay", "val_fraction")]
    tag = hashlib.sha256(str(base.resolve()).encode()).hexdigest()[:8]  # another base, other answers
    rows = [{"variant": "base model, not fine-tuned", "summary": None,
             "correct": evaluate(base, sft / f"base-{tag}-heldout-answers.jsonl", len(kinds),
                                 [x for s in base_sets for x in ("--set", s)])}]
    for name in order:
        run = sft / name
        rows.append({"variant": name, "summary": json.loads((run / "summary.json").read_text()),
                     "correct": evaluate(run, run / "heldout-answers.jsonl", len(kinds))})
    full = next((r for r in rows if r["summary"] and r["summary"]["trainable_params"] == r["summary"]["params"]), None)
    task_names = sorted(set(kinds))
    print()
    print("| method | lr | trainable params | share | optimizer state (MB) | adapter (MB) | peak mem (MB) | "
          "step (ms) | exact match | " + " | ".join(task_names) + " | vs full (95 % CI) |")
    print("| --- " * (10 + len(task_names)) + "|")
    for r in rows:
        correct = r["correct"]
        by_task = defaultdict(list)
        for kind, ok in zip(kinds, correct):
            by_task[kind].append(ok)
        em = correct.mean()
        cells = [f"{em:.3f}"] + [f"{np.mean(by_task[k]):.3f}" for k in task_names] + [ratio(correct, full)]
        s = r["summary"]
        if s is None:
            print(f"| {r['variant']} | | | | | | | | " + " | ".join(cells) + " |")
            continue
        m = tomllib.loads((sft / r["variant"] / "manifest.toml").read_text())
        tokens = m["train"]["batch_size"] * m["train"]["grad_accum"] * m["model"]["block_size"]
        adapter = s.get("adapter_bytes")
        print(f"| {method(m['peft'])} | {m['optimizer']['lr']:g} | {s['trainable_params']:,} | "
              f"{s['trainable_params'] / s['params']:.2%} | "
              f"{s.get('optimizer_state_bytes', float('nan')) / 2**20:.1f} | "
              f"{f'{adapter / 2**20:.2f}' if adapter else '—'} | {s.get('peak_mem_mb', float('nan')):.0f} | "
              f"{1000 * tokens / s['tokens_per_s']:.0f} | " + " | ".join(cells) + " |")
    print(f"\nheld-out records: {len(kinds)} ({', '.join(f'{k} {kinds.count(k)}' for k in task_names)})")


def method(peft: dict) -> str:
    """``lora r=8 q,v``: the plugin, then the options that tell variants of it apart."""
    words = [peft["use"] if peft["use"] != "none" else "full fine-tune"]
    if "r" in peft:
        words.append(f"r={peft['r']}")
    if "targets" in peft:
        words.append(",".join(peft["targets"]))
    return " ".join(words)


def evaluate(run: Path, answers: Path, count: int, sets: list[str] = ()) -> np.ndarray:
    """Whether each of the first ``count`` held-out answers of ``run`` is right (``lmlab eval``; the
    answers are kept and reused while they cover the same records)."""
    lines = answers.read_text().splitlines() if answers.is_file() else []
    if len(lines) != count:
        lmlab("eval", str(run), "--data", str(HELD_OUT), "--out", str(answers), "--limit", str(count), *sets)
        lines = answers.read_text().splitlines()
    return np.array([json.loads(line)["correct"] for line in lines], dtype=float)


def ratio(correct: np.ndarray, full: dict | None) -> str:
    """Exact match over full fine-tuning's, with a paired bootstrap's 95 % interval (the same records
    resampled for both, so that what they share, the records' difficulty, cancels)."""
    if full is None or full["correct"].sum() == 0:
        return ""
    theirs = full["correct"]
    index = np.random.default_rng(0).integers(0, len(correct), (BOOTSTRAP, len(correct)))
    ratios = correct[index].mean(1) / np.maximum(theirs[index].mean(1), 1e-12)
    low, high = np.percentile(ratios, [2.5, 97.5])
    return f"{correct.mean() / theirs.mean():.2f} ({low:.2f}–{high:.2f})"


if __name__ == "__main__":
    main()
