"""bias-score's lexicon: target groups and attribute terms, each a list of single words.

A TOML file with two tables, ``[groups]`` (at least two: an association is one group against the
others) and ``[attributes]`` (at least one), each mapping a name to its surface forms. Words match in
lower case as whole words (runs of letters), so each form must be one such run, and a word may belong
to one entry only: a word that were both a group and an attribute would co-occur with itself.
"""

import re
import tomllib
from importlib import resources
from pathlib import Path
from typing import NamedTuple

#: What counts as a word, in the text and in the lexicon: a run of letters (``she's`` is ``she``, ``s``).
WORD = re.compile(r"[^\W\d_]+")
SHIPPED = "bias_lexicon.toml"


class Lexicon(NamedTuple):
    groups: tuple[str, ...]
    attributes: tuple[str, ...]
    #: word → (0, group index) or (1, attribute index)
    index: dict[str, tuple[int, int]]


def load(path: Path | None) -> Lexicon:
    """The lexicon in ``path`` (None: the shipped one); ValueError says what is wrong with a file."""
    if path is None:
        return parse(resources.files(__package__).joinpath(SHIPPED).read_text("utf-8"), SHIPPED)
    try:
        text = Path(path).read_text("utf-8")
    except FileNotFoundError:
        raise ValueError(f"{path}: no such lexicon file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read the lexicon ({exc})") from None
    return parse(text, str(path))


def parse(text: str, source: str) -> Lexicon:
    if not text.strip():
        raise ValueError(f"{source}: the lexicon is empty; it needs [groups] (two or more) and [attributes]")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{source}: not valid TOML ({exc})") from None
    unknown = sorted(set(data) - {"groups", "attributes"})
    if unknown:
        raise ValueError(f"{source}: unknown table {unknown[0]!r}; a lexicon has [groups] and [attributes]")
    index: dict[str, tuple[int, int]] = {}
    names: list[list[str]] = [[], []]
    for kind, (table, least) in enumerate((("groups", 2), ("attributes", 1))):
        entries = data.get(table, {})
        if not isinstance(entries, dict) or len(entries) < least:
            raise ValueError(f"{source}: [{table}] needs at least {least} "
                             f"{'entries' if least > 1 else 'entry'} (name = [\"word\", ...])")
        for name, words in entries.items():
            where = f"{source}: {table}.{name}"
            if not isinstance(words, list) or not words or not all(isinstance(w, str) for w in words):
                raise ValueError(f"{where} must be a non-empty list of words")
            for word in words:
                lowered = word.lower()
                if not WORD.fullmatch(lowered):
                    raise ValueError(f"{where}: {word!r} is not one word of letters")
                if lowered in index:
                    kind_before, i = index[lowered]
                    other = ("groups", "attributes")[kind_before] + "." + (names[kind_before][i])
                    raise ValueError(f"{where}: {word!r} is also in {other}; a word belongs to one entry")
                index[lowered] = (kind, len(names[kind]))
            names[kind].append(name)
    return Lexicon(tuple(names[0]), tuple(names[1]), index)
