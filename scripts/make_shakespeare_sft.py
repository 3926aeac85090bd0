#!/usr/bin/env python3
"""Writes the Shakespeare instruction task: Alpaca-format records made from data/tinyshakespeare.txt.

Three kinds of instruction, one record of each per speech (a speaker's turn), about 21,000 in all.
Each asks for something the pretrained model learned, so the comparison of fine-tuning methods
measures how well each one teaches the model to *use* its knowledge in the instruction format:

- ``speaker``: "Who speaks this line?" — the character's name, which the input does not hold.
- ``finish-word``: "Finish the last word of this line." — the input stops inside its last word
  (after at least two of its letters, at least two letters short of its end); the answer is the
  rest of the word.
- ``next-word``: "Which word comes next?" — the input is the line's first words (at least two);
  the answer is the word that follows.

Tasks that copy from the input (the line's last word, the line in capitals) are not among them: a
character model pretrained for tens of CPU minutes has formed no induction heads (its loss on the
second copy of a repeated line equals the first's), so no method learns to copy in a short
fine-tune and those tasks would score zero for all of them.

Every 10th speech goes to the held-out set, the rest to the training set, so held-out lines are never
fine-tuned on (they were seen in pretraining, as any instruction-tuned model's knowledge was). Lines
come from a generator seeded with 0, so the files are the same on every machine. Only characters of
the corpus are used, so the character tokenizer fitted on tinyshakespeare encodes every record.

    python scripts/make_shakespeare_sft.py              # writes data/shakespeare-sft/{train,heldout}.jsonl.gz
"""

import argparse
import gzip
import io
import json
import random
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "data" / "tinyshakespeare.txt"
HELD_OUT_EVERY = 10
MIN_CHARS, MAX_CHARS = 20, 50  # lines worth asking about, short enough for a 192-token window


def speeches(text: str) -> list[tuple[str, list[str]]]:
    """(speaker, lines) of every speech: blocks separated by a blank line, the first line "NAME:"."""
    out = []
    for block in text.split("\n\n"):
        lines = block.strip("\n").split("\n")
        if len(lines) >= 2 and lines[0].endswith(":"):
            out.append((lines[0][:-1], lines[1:]))
    return out


def records(speaker: str, lines: list[str], rng: random.Random) -> list[dict]:
    usable = [line for line in lines if MIN_CHARS <= len(line) <= MAX_CHARS and re.search(r"[A-Za-z]", line)]
    if not usable:
        return []
    line = rng.choice(usable)
    # Each input ends where its answer starts (a line break, a space, the middle of a word).
    out = [{"task": "speaker", "instruction": "Who speaks this line?", "input": line + "\n", "output": speaker}]
    words = list(re.finditer(r"[A-Za-z']+", line))
    last = words[-1] if words else None
    if last and len(last.group()) >= 4:
        cut = last.start() + rng.randint(2, len(last.group()) - 2)
        out.append({"task": "finish-word", "instruction": "Finish the last word of this line.",
                    "input": line[:cut], "output": line[cut:last.end()]})
    if len(words) >= 3:
        k = rng.randint(2, len(words) - 1)
        out.append({"task": "next-word", "instruction": "Which word comes next?",
                    "input": line[:words[k].start()], "output": words[k].group()})
    return out


def build(text: str) -> dict[str, list[dict]]:
    rng = random.Random(0)
    splits = {"train": [], "heldout": []}
    for i, (speaker, lines) in enumerate(speeches(text)):
        splits["heldout" if i % HELD_OUT_EVERY == 0 else "train"].extend(records(speaker, lines, rng))
    return splits


def write(records_: list[dict], path: Path) -> None:
    # mtime=0 and no file name in the gzip header: the same bytes on every run.
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0, filename="") as f:
        for record in records_:
            f.write((json.dumps(record, ensure_ascii=False) + "\n").encode())
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(buffer.getvalue())
    tmp.replace(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "data" / "shakespeare-sft")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name, rows in build(SOURCE.read_text()).items():
        write(rows, args.out / f"{name}.jsonl.gz")
        print(f"{args.out / f'{name}.jsonl.gz'}: {len(rows)} records")


if __name__ == "__main__":
    main()
