"""Fine-tuning methods compared on the Shakespeare instruction task: one table per method.

Runs ``experiments/sft-pretrain.toml`` (the 10.7 M-parameter base model; skipped when its run is
complete, as any finished variant is), then the ``experiments/sft-peft.toml`` sweep (full fine-tune,
LoRA r=8 on q/v, bottleneck adapter, IA3, QLoRA), then ``lmlab eval`` of each variant on the held-out
records. Printed per method: trainable parameters (and their share), optimizer-state memory, the
adapter file's size, peak memory, the median step time, held-out exact match overall and per task,
and the ratio of each method's exact match to full fine-tuning's (the issue's target for LoRA: at
least 0.9, with under 2 % of the parameters trained).

    python bench/sft_peft.py [--runs runs] [--pretrained RUN] [--limit N] [--set train.max_steps=300 ...]

Everything goes through the CLI, as a user would run it; the runs stay in ``--runs`` so that the
table can be printed again (finished runs are not trained again).
"""

import argparse
import gzip
import json
import subprocess
import sys
import tomllib
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HELD_OUT = ROOT / "data" / "shakespeare-sft" / "heldout.jsonl.gz"


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
    lmlab("run", str(ROOT / "experiments" / "sft-peft.toml"), "--out", str(sft), *(x for s in sets for x in ("--set", s)))
    order = json.loads((sft / "sweep.json").read_text())["variants"]
    kinds = tasks(args.limit)
    rows = []
    for name in order:
        run = sft / name
        answers = run / "heldout-answers.jsonl"
        if not answers.is_file():
            lmlab("eval", str(run), "--data", str(HELD_OUT), "--out", str(answers),
                  *(["--limit", str(args.limit)] if args.limit else []))
        correct = [json.loads(line)["correct"] for line in answers.read_text().splitlines()]
        by_task = defaultdict(list)
        for kind, ok in zip(kinds, correct):
            by_task[kind].append(ok)
        summary = json.loads((run / "summary.json").read_text())
        rows.append({"variant": name, "summary": summary, "em": sum(correct) / len(correct),
                     "tasks": {k: sum(v) / len(v) for k, v in by_task.items()}})
    full = next((r["em"] for r in rows if "none" in r["variant"]), None)
    task_names = sorted({k for r in rows for k in r["tasks"]})
    print()
    print("| method | trainable params | share | optimizer state (MB) | adapter (MB) | peak mem (MB) | "
          "step (ms) | exact match | " + " | ".join(task_names) + " | vs full |")
    print("| --- " * (9 + len(task_names)) + "|")
    for r in rows:
        s = r["summary"]
        m = tomllib.loads((sft / r["variant"] / "manifest.toml").read_text())
        tokens = m["train"]["batch_size"] * m["train"]["grad_accum"] * m["model"]["block_size"]
        step_ms = 1000 * tokens / s["tokens_per_s"]
        share = s["trainable_params"] / s["params"]
        adapter = s.get("adapter_bytes")
        print(f"| {r['variant']} | {s['trainable_params']:,} | {share:.2%} | "
              f"{s.get('optimizer_state_bytes', float('nan')) / 2**20:.1f} | "
              f"{adapter / 2**20 if adapter else float('nan'):.2f} | {s.get('peak_mem_mb', float('nan')):.0f} | "
              f"{step_ms:.0f} | {r['em']:.3f} | " + " | ".join(f"{r['tasks'][k]:.3f}" for k in task_names)
              + f" | {r['em'] / full if full else float('nan'):.2f} |")


if __name__ == "__main__":
    main()
