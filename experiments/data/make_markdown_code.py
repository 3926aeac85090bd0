"""Writes markdown-code.jsonl: a small corpus of markdown documents that mix prose and fenced code.

Used by experiments/mlm.toml (masked language modelling with a higher mask rate inside code blocks).
The prose is consecutive lines of tinyshakespeare, the code small generated Python functions; each
document is a heading, paragraphs, and one or two ```python blocks. Deterministic (seed 0):

    python experiments/data/make_markdown_code.py
"""

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHAKESPEARE = HERE.parent.parent / "data" / "tinyshakespeare.txt"
DOCUMENTS = 400

NAMES = ["total", "count", "scale", "merge", "split", "clamp", "window", "parse", "render", "score", "blend", "shift"]
VARS = ["x", "y", "n", "items", "value", "data", "size", "limit", "step", "text"]
TEMPLATES = [
    "def {f}({a}, {b}):\n    result = 0\n    for i in range({a}):\n        result += i * {b}\n    return result\n",
    "def {f}({a}):\n    if {a} < {k}:\n        return {k}\n    return {a} - {k}\n",
    "def {f}({a}, {b}={k}):\n    out = []\n    for item in {a}:\n        out.append(item + {b})\n    return out\n",
    "class {F}:\n    def __init__(self, {a}):\n        self.{a} = {a}\n\n    def {f}(self):\n        return self.{a} * {k}\n",
    "def {f}({a}):\n    return [v for v in {a} if v % {k} == 0]\n",
    "def {f}({a}, {b}):\n    while {a} > {b}:\n        {a} = {a} // 2\n    return {a}\n",
]


def code(rng: random.Random) -> str:
    f = rng.choice(NAMES) + "_" + rng.choice(VARS)
    a, b = rng.sample(VARS, 2)
    return rng.choice(TEMPLATES).format(f=f, F=f.title().replace("_", ""), a=a, b=b, k=rng.randint(2, 9))


def main() -> None:
    rng = random.Random(0)
    lines = [line for line in SHAKESPEARE.read_text().splitlines() if line.strip()]
    at = 0

    def paragraph() -> str:
        nonlocal at
        n = rng.randint(2, 5)
        text = " ".join(lines[at:at + n])
        at = (at + n) % (len(lines) - 5)
        return text

    with open(HERE / "markdown-code.jsonl", "w") as f:
        for _ in range(DOCUMENTS):
            parts = [f"# {rng.choice(NAMES).title()} {rng.choice(VARS)}", paragraph()]
            for _ in range(rng.randint(1, 2)):
                parts += [f"```python\n{code(rng)}```", paragraph()]
            f.write(json.dumps({"text": "\n\n".join(parts) + "\n"}) + "\n")


if __name__ == "__main__":
    main()
