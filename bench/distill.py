"""Distillation against plain fine-tuning on the Shakespeare instruction task, measured per sub-task.

Runs the teacher's chain (experiments/alignment-base.toml → alignment-sft.toml, a 4 x 128 SFT run),
the student's pretraining (experiments/distill-student.toml, 2 x 64) and the experiments/distill.toml
sweep (the student fine-tuned alone, distilled, and distilled with the speaker task weighted 4x;
finished runs are not trained again). Then, for the teacher and each student, on the held-out
instruction records (data/shakespeare-sft/heldout.jsonl.gz), overall and per task (speaker,
finish-word, next-word):

- held-out loss: the mean cross-entropy of the answer tokens (``val_hard_loss`` of ``lmlab eval`` under
  the distill objective, which scores exactly the answers, as ``sft`` trains on them);
- exact match of greedy answers (``lmlab eval``).

    python bench/distill.py [--limit N]

The runs go to runs/ at the repository root, where the manifests' [init] tables look for them.
"""

import argparse
import gzip
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXPERIMENTS = ROOT / "experiments"
HELD_OUT = ROOT / "data" / "shakespeare-sft" / "heldout.jsonl.gz"
AS_RECORDS = ["data.use=alpaca", 'data.prompt_template="{instruction}\\n{input}"', 'data.response_end="\\n"']


def lmlab(*args: str) -> str:
    print("$ lmlab " + " ".join(args), flush=True)
    return subprocess.run([sys.executable, "-m", "lmlab", *args], check=True, capture_output=True,
                          text=True).stdout


def sets(*pairs: str) -> list[str]:
    return [arg for pair in pairs for arg in ("--set", pair)]


def measure(run: Path, teacher: Path, data: Path) -> tuple[float, float]:
    """(held-out answer loss, exact match) of ``run`` on the records in ``data``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "scores.json"
        lmlab("eval", str(run), "--data", str(data), "--out", str(out),
              *sets(*AS_RECORDS, "objective.use=distill", f"objective.teacher={json.dumps(str(teacher))}"))
        loss = json.loads(out.read_text())["val_hard_loss"]
    printed = lmlab("eval", str(run), "--data", str(data), *sets(*AS_RECORDS, "objective.use=sft"))
    return loss, float(re.search(r"exact match ([0-9.]+)", printed).group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=None, help="score only the first N held-out records per task")
    args = parser.parse_args()
    runs = ROOT / "runs"
    for stage in ("alignment-base", "alignment-sft", "distill-student", "distill"):
        lmlab("run", str(EXPERIMENTS / f"{stage}.toml"), "--out", str(runs / stage))
    teacher = runs / "alignment-sft" / "default"
    models = {"teacher (4 x 128, sft)": teacher}
    labels = {"sft": "student alone (sft)", "distill": "student distilled"}
    for variant in sorted((runs / "distill").iterdir()):
        if not (variant / "manifest.toml").is_file():
            continue
        name = labels["distill" if "objective=distill" in variant.name else "sft"]
        models[name + (", speaker x4" if "task_weights" in variant.name else "")] = variant
    with gzip.open(HELD_OUT, "rt") as f:
        records = [json.loads(line) for line in f]
    with tempfile.TemporaryDirectory() as tmp:
        files = {"all": Path(tmp) / "all.jsonl"}
        groups = {"all": records}
        for task in sorted({r["task"] for r in records}):
            groups[task] = [r for r in records if r["task"] == task]
            files[task] = Path(tmp) / f"{task}.jsonl"
        for name, rows in groups.items():
            files[name].write_text("".join(json.dumps(r) + "\n" for r in rows[:args.limit]))
        table = {model: {group: measure(run, teacher, files[group]) for group in groups}
                 for model, run in models.items()}
    header = list(groups)
    print("\n| model | " + " | ".join(f"{g} loss | {g} exact" for g in header) + " |")
    print("| --- | " + " | ".join("---: | ---:" for _ in header) + " |")
    for model, row in table.items():
        print(f"| {model} | " + " | ".join(f"{row[g][0]:.4f} | {row[g][1]:.4f}" for g in header) + " |")


if __name__ == "__main__":
    main()
