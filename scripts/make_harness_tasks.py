#!/usr/bin/env python3
"""Writes the evaluation tasks lmlab ships for lm-evaluation-harness, from data in the repository, so
that ``lmlab eval --tasks`` scores runs without a network (core/lmlab/harness/tasks/):

- ``shakespeare_next_line`` (multiple choice): two consecutive lines of the tinyshakespeare
  validation split (its last 10 %, which no run trains on), then which of four lines comes next: the
  true one, or one of three drawn from elsewhere in the split. Accuracy, and accuracy normalised by
  the choice's length.
- ``shakespeare_ppl`` (rolling log-likelihood): the validation split cut into passages of about
  1,000 characters at line ends. Word and byte perplexity, bits per byte.
- ``shakespeare_instructions`` (generation): the held-out records of the Shakespeare instruction task
  (data/shakespeare-sft, scripts/make_shakespeare_sft.py) as prompts "{instruction}\\n{input}", each
  answer ending at a newline. Exact match.

Lines come from a generator seeded with 0, so the files are the same on every machine.

    python scripts/make_harness_tasks.py
"""

import argparse
import gzip
import io
import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "data" / "tinyshakespeare.txt"
INSTRUCTIONS = ROOT / "data" / "shakespeare-sft" / "heldout.jsonl.gz"
OUT = ROOT / "core" / "lmlab" / "harness" / "tasks"
VAL_FRACTION = 0.1
QUESTIONS, PASSAGES, ANSWERS = 200, 40, 300
MIN_CHARS, MAX_CHARS = 20, 60


def validation_lines() -> list[str]:
    text = SOURCE.read_text(encoding="utf-8")
    val = text[int(len(text) * (1 - VAL_FRACTION)):]
    return val[val.index("\n") + 1:].split("\n")  # from the first whole line


def next_line(lines: list[str], rng: random.Random) -> list[dict]:
    usable = [i for i in range(2, len(lines)) if MIN_CHARS <= len(lines[i]) <= MAX_CHARS and lines[i - 1] and lines[i - 2]]
    pool = [line for line in lines if MIN_CHARS <= len(line) <= MAX_CHARS]
    out = []
    for i in sorted(rng.sample(usable, QUESTIONS)):
        wrong = rng.sample([line for line in pool if line != lines[i]], 3)
        choices = [lines[i], *wrong]
        rng.shuffle(choices)
        out.append({"context": f"{lines[i - 2]}\n{lines[i - 1]}\n", "choices": choices, "gold": choices.index(lines[i])})
    return out


def passages(lines: list[str]) -> list[dict]:
    out, current = [], ""
    for line in lines:
        current += line + "\n"
        if len(current) >= 1000:
            out.append({"text": current})
            current = ""
    return out[:PASSAGES]


def instructions(rng: random.Random) -> list[dict]:
    with gzip.open(INSTRUCTIONS, "rt", encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    return [{k: r[k] for k in ("task", "instruction", "input", "output")} for r in sorted(rng.sample(records, ANSWERS),
                                                                                        key=records.index)]


def write(path: Path, rows: list[dict]) -> None:
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0) as f:  # mtime 0: the same bytes every time
        f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8"))
    path.write_bytes(buffer.getvalue())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    lines = validation_lines()
    write(args.out / "shakespeare_next_line.jsonl.gz", next_line(lines, random.Random(0)))
    write(args.out / "shakespeare_ppl.jsonl.gz", passages(lines))
    write(args.out / "shakespeare_instructions.jsonl.gz", instructions(random.Random(0)))


if __name__ == "__main__":
    main()
