"""What `code-sanitize`'s rules match in real code: this Python's standard library.

Reads every ``*.py`` under ``sysconfig``'s stdlib, site-packages left out (third-party code installed
there is not the standard library), finds
each file's comments and docstrings as the filter does (Python's own tokenizer and ``ast``), and
prints, per rule, how many comments it matched in how many files, with five matches sampled at random
(a fixed seed) so a reader can judge the rule's precision. A precision figure needs a person to read
the matches; this script only puts them in front of one.

    python bench/code_sanitize.py [--samples 5] [--seed 0]
"""

import argparse
import random
import sysconfig
from collections import defaultdict
from pathlib import Path

from lmlab_filters.code_sanitize import matches

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=5, help="matches shown per rule")
    parser.add_argument("--seed", type=int, default=0, help="which matches are shown")
    args = parser.parse_args()
    found: dict[str, list[tuple[str, str]]] = defaultdict(list)
    files: dict[str, set[str]] = defaultdict(set)
    read = 0
    for path in sorted(STDLIB.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        read += 1
        where = str(path.relative_to(STDLIB))
        for rule, comment in matches(text):
            found[rule].append((where, comment))
            files[rule].add(where)
    print(f"{read:,} files of {STDLIB}\n")
    print("| rule | comments matched | files |")
    print("| --- | ---: | ---: |")
    for rule in sorted(found):
        print(f"| `{rule}` | {len(found[rule]):,} | {len(files[rule]):,} |")
    rng = random.Random(args.seed)
    for rule in sorted(found):
        print(f"\n{rule}:")
        for where, comment in rng.sample(found[rule], min(args.samples, len(found[rule]))):
            shown = " ".join(comment.split())
            print(f"  {where}: {shown[:150]}")


if __name__ == "__main__":
    main()
