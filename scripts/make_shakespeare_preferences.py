#!/usr/bin/env python3
"""Writes the Shakespeare preference set: the instruction task's records, each with a wrong answer.

Made from data/shakespeare-sft/ (which scripts/make_shakespeare_sft.py writes from
data/tinyshakespeare.txt), one pair per instruction record, for preference objectives (DPO, reward
models) and the ``preferences`` data plugin: ``{"task", "prompt", "chosen", "rejected"}``, where the
prompt is the record's instruction and input joined by a newline (the template "{instruction}\\n{input}"
that the sft-peft experiments use), the chosen answer is the record's output and the rejected one a
plausible wrong answer of the same kind, so a model cannot tell them apart by their form alone:

- ``speaker``: another speaker of the same split's speaker records, drawn as often as it speaks there
  (a wrong name that is common, not a rarity the model never saw).
- ``finish-word``: the ending of another word of the corpus that starts as the input's last word
  does ("fami" → "sh" chosen, "liar" rejected); where the corpus has none, the true ending with its
  letters shuffled, or one letter replaced where shuffling cannot change it.
- ``next-word``: another word of the corpus of about the same frequency (the same power-of-two band
  of counts, the nearest non-empty band where it is alone), capitalised as the true word is.

Held-out pairs come only from held-out records, and their speakers only from held-out speaker
records. The instruction set holds out by speech, so a held-out prompt is also a training prompt only
where the corpus repeats a line or a line's opening words (next-word prompts such as "Of the ");
tests/test_shakespeare_preferences.py bounds how often. Every answer uses only characters of the
corpus, so the character tokenizer fitted on tinyshakespeare encodes every pair. Each split has its
own generator (seeded with 0 and 1) and the gzip header no time stamp, so the files are the same
bytes on every run. The training file is small enough to ship whole (about 15,000 pairs).

    python scripts/make_shakespeare_preferences.py      # writes data/shakespeare-prefs/{train,heldout}.jsonl.gz
"""

import argparse
import bisect
import collections
import gzip
import io
import json
import math
import random
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "data" / "tinyshakespeare.txt"
SOURCE = ROOT / "data" / "shakespeare-sft"
SPLITS = {"train": 0, "heldout": 1}  # split → its generator's seed
WORD = re.compile(r"[A-Za-z']+")  # a word as the instruction set cuts them
LETTERS = "abcdefghijklmnopqrstuvwxyz"


class Vocabulary:
    """The corpus's words, their counts, and ways to find a plausible other word."""

    def __init__(self, text: str):
        self.counts = collections.Counter(WORD.findall(text))
        self.sorted = sorted(self.counts)  # for words by prefix
        self.bands: dict[tuple[int, bool], list[str]] = collections.defaultdict(list)
        for word in self.sorted:
            self.bands[self.band(word)].append(word)

    def band(self, word: str) -> tuple[int, bool]:
        return int(math.log2(self.counts.get(word, 1))), word[0].isupper()

    def starting_with(self, prefix: str) -> list[str]:
        i = bisect.bisect_left(self.sorted, prefix)
        out = []
        while i < len(self.sorted) and self.sorted[i].startswith(prefix):
            out.append(self.sorted[i])
            i += 1
        return out

    def similar(self, word: str, rng: random.Random) -> str:
        """Another word of about the same frequency, capitalised alike."""
        level, upper = self.band(word)
        for distance in range(0, 64):
            # The band itself, then the nearest ones, rarer first (the frequent bands are small).
            for near in dict.fromkeys((level - distance, level + distance)):
                candidates = [w for w in self.bands.get((near, upper), []) if w != word]
                if candidates:
                    return rng.choice(candidates)
        raise ValueError(f"the corpus has no word like {word!r}")


def wrong_speaker(true: str, speakers: list[str], rng: random.Random) -> str:
    if not any(s != true for s in speakers):
        raise ValueError("the split has a single speaker: no wrong one to draw")
    while (other := rng.choice(speakers)) == true:
        pass
    return other


def wrong_ending(given: str, ending: str, vocabulary: Vocabulary, rng: random.Random) -> str:
    match = re.search(r"[A-Za-z']+$", given)
    prefix = match.group() if match else ""
    true_word = prefix + ending
    others = [w for w in vocabulary.starting_with(prefix) if w != true_word and len(w) > len(prefix)] if prefix else []
    # An ending that merely extends the true one ("friar" → "friar's") starts right: avoid it where possible.
    others = [w for w in others if not w.startswith(true_word)] or others
    if others:
        return rng.choice(others)[len(prefix):]
    return corrupted(ending, rng)


def corrupted(ending: str, rng: random.Random) -> str:
    """The ending with its letters shuffled (apostrophes stay put), or one letter replaced where no
    shuffle changes it ("ss", "'d")."""
    chars = list(ending)
    letters = [i for i, c in enumerate(chars) if c.isalpha()]
    if len({chars[i] for i in letters}) > 1:
        while True:
            order = letters[:]
            rng.shuffle(order)
            shuffled = chars[:]
            for i, j in zip(letters, order):
                shuffled[i] = chars[j]
            if shuffled != chars:
                return "".join(shuffled)
    i = rng.choice(letters) if letters else rng.randrange(len(chars))
    old = chars[i]
    new = rng.choice([c for c in LETTERS if c != old.lower()])
    chars[i] = new.upper() if old.isupper() else new
    return "".join(chars)


def pairs(records: list[dict], vocabulary: Vocabulary, rng: random.Random) -> list[dict]:
    speakers = [r["output"] for r in records if r["task"] == "speaker"]
    out = []
    for r in records:
        task, chosen = r["task"], r["output"]
        if task == "speaker":
            rejected = wrong_speaker(chosen, speakers, rng)
        elif task == "finish-word":
            rejected = wrong_ending(r["input"], chosen, vocabulary, rng)
        elif task == "next-word":
            rejected = vocabulary.similar(chosen, rng)
        else:
            raise ValueError(f"unknown task {task!r}")
        assert rejected != chosen, r
        out.append({"task": task, "prompt": f"{r['instruction']}\n{r['input']}", "chosen": chosen,
                    "rejected": rejected})
    return out


def load(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def build(source: Path = SOURCE, corpus: Path = CORPUS) -> dict[str, list[dict]]:
    vocabulary = Vocabulary(corpus.read_text())
    return {name: pairs(load(source / f"{name}.jsonl.gz"), vocabulary, random.Random(seed))
            for name, seed in SPLITS.items()}


def write(rows: list[dict], path: Path) -> None:
    # mtime=0 and no file name in the gzip header: the same bytes on every run.
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0, filename="") as f:
        for row in rows:
            f.write((json.dumps(row, ensure_ascii=False) + "\n").encode())
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(buffer.getvalue())
    tmp.replace(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "data" / "shakespeare-prefs")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, rows in build().items():
        path = args.out / f"{name}.jsonl.gz"
        write(rows, path)
        tasks = collections.Counter(row["task"] for row in rows)
        print(f"{path}: {len(rows)} pairs ({', '.join(f'{t} {n}' for t, n in sorted(tasks.items()))})")


if __name__ == "__main__":
    main()
