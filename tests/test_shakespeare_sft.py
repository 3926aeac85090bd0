"""The shipped instruction task is what scripts/make_shakespeare_sft.py writes, and its records ask
what they say: each answer follows its input in the corpus, and held-out lines are never trained on."""

import bisect
import gzip
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "data" / "shakespeare-sft"


def load(path: Path) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f]


def test_the_script_writes_the_shipped_files_byte_for_byte(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_shakespeare_sft.py"), "--out", str(tmp_path)],
                   check=True, capture_output=True)
    for name in ("train.jsonl.gz", "heldout.jsonl.gz"):
        assert (tmp_path / name).read_bytes() == (SHIPPED / name).read_bytes(), name


def test_every_answer_follows_its_input_in_the_corpus_and_held_out_lines_are_not_trained_on():
    corpus = (ROOT / "data" / "tinyshakespeare.txt").read_text()
    lines = set(corpus.split("\n"))
    ordered = sorted(lines)
    starts_a_line = lambda text: ordered[bisect.bisect_left(ordered, text)].startswith(text)  # noqa: E731
    train, heldout = load(SHIPPED / "train.jsonl.gz"), load(SHIPPED / "heldout.jsonl.gz")
    assert len(train) > 10 * len(heldout) / 2 and len(heldout) > 1500
    for record in train + heldout:
        task, given, answer = record["task"], record["input"], record["output"]
        if task == "speaker":
            line = given.removesuffix("\n")
            assert line in lines and f"{answer}:\n" in corpus
        elif task == "finish-word":
            # the cut falls inside the last word: at least two letters on each side
            assert re.search(r"[A-Za-z']{2}$", given) and re.fullmatch(r"[A-Za-z']{2,}", answer)
            assert starts_a_line(given + answer)
        else:
            # the input stops between words (after a space, or a hyphen or dash that joins them)
            assert task == "next-word" and re.search(r"[^A-Za-z']$", given) and re.fullmatch(r"[A-Za-z']+", answer)
            assert starts_a_line(given + answer)
    # Held out by speech: a held-out line is in the training set only where the corpus repeats it.
    speaker_lines = [{r["input"] for r in rs if r["task"] == "speaker"} for rs in (train, heldout)]
    assert len(speaker_lines[0] & speaker_lines[1]) < 0.02 * len(speaker_lines[1])
