"""Curriculum learning: training draws from the easiest documents first, then from all of them.

``[data] curriculum`` ranks the training documents by a difficulty score (Bengio et al. 2009):

- ``length``: tokens in the document (short sentences first, as in Spitkovsky et al. 2010 and the
  length curricula of machine translation);
- ``rarity``: the mean over its tokens of −log of their unigram frequency in the training split
  (Platanios et al. 2019's word-rarity difficulty);
- ``objective``: the objective's own score (``Objective.difficulty``, e.g. a teacher's loss).

At step s the sampler draws only from the easiest ⌈c(s)·N⌉ documents, where the competence c grows
from ``curriculum_start`` at step 0 to 1 at ``curriculum_steps``: linearly, or as
c(s) = min(1, sqrt(s·(1 − c0²)/S + c0²)) (``root``, Platanios et al. 2019, which gives each newly
added document as much time as the earlier ones had). Ties in difficulty keep corpus order, and the
draw of step s is seeded by (seed, step) like every other draw, so a resumed run sees the same
documents. From ``curriculum_steps`` on, sampling is the ordinary one.
"""

import math
from dataclasses import dataclass

import numpy as np

from lmlab.api import UserError

#: Tokens read at once when a split is scanned (counts, per-document sums).
_CHUNK = 1 << 22


@dataclass(frozen=True)
class Curriculum:
    """The training documents from easiest to hardest, and how fast training reaches all of them."""

    order: np.ndarray  # (N,) int64: indices of the non-empty training documents, easiest first
    start: float  # competence at step 0
    steps: int  # the step at which competence reaches 1
    pacing: str  # "linear" or "root"

    def competence(self, step: int) -> float:
        """The share of documents available at ``step``."""
        if step >= self.steps:
            return 1.0
        t, c0 = step / self.steps, self.start
        if self.pacing == "linear":
            return min(1.0, c0 + (1.0 - c0) * t)
        return min(1.0, math.sqrt(t * (1.0 - c0 * c0) + c0 * c0))

    def available(self, step: int) -> int:
        """How many of the easiest documents training draws from at ``step`` (at least one)."""
        n = len(self.order)
        return n if step >= self.steps else max(1, min(n, math.ceil(self.competence(step) * n)))


def lengths(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    return (ends - starts).astype(np.float64)


def rarity(tokens, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Each document's mean −log unigram frequency, the frequencies counted over the whole split."""
    counts = np.zeros(1, dtype=np.int64)
    for a in range(0, len(tokens), _CHUNK):
        found = np.bincount(np.asarray(tokens[a:a + _CHUNK]).astype(np.int64))
        if len(found) > len(counts):
            found, counts = counts, found
        counts[:len(found)] += found
    surprise = -np.log(np.maximum(counts, 1) / max(int(counts.sum()), 1))  # (V,)
    out = np.empty(len(starts), dtype=np.float64)
    # Documents in groups of about _CHUNK tokens, so a large split is never in memory as floats.
    first = 0
    while first < len(starts):
        last = int(np.searchsorted(ends, starts[first] + _CHUNK, side="right"))
        last = max(last, first + 1)
        base = int(starts[first])
        values = surprise[np.asarray(tokens[base:int(ends[last - 1])]).astype(np.int64)]
        values = np.append(values, 0.0)  # reduceat needs each end index inside the array
        bounds = np.stack([starts[first:last] - base, ends[first:last] - base], axis=1).reshape(-1)
        out[first:last] = np.add.reduceat(values, bounds)[::2]
        first = last
    return out / np.maximum(ends - starts, 1)


def build(options, tokens, objective, starts: np.ndarray, ends: np.ndarray, keep: np.ndarray) -> Curriculum | None:
    """The curriculum ``options`` (the data plugin's) ask for over the training split, or None.
    ``starts``/``ends``: the non-empty documents the sampler draws, ``keep`` which entries of
    ``document_starts`` they are (for a score per document of the objective's)."""
    kind = getattr(options, "curriculum", "none")
    if kind == "none":
        return None
    if len(starts) < 2:
        raise UserError(f"a curriculum orders the training documents, and the training split holds {len(starts)}; "
                        "use a corpus of many documents (jsonl, alpaca, preferences) or curriculum = \"none\"",
                        key="data.curriculum")
    if kind == "length":
        score = lengths(starts, ends)
    elif kind == "rarity":
        score = rarity(tokens.train, starts, ends)
    else:
        given = objective.difficulty(tokens.split("train"))
        if given is None:
            raise UserError(f"objective {objective.name!r} gives no difficulty score (Objective.difficulty); use "
                            "length or rarity", key="data.curriculum")
        given = np.asarray(given, dtype=np.float64)
        if given.shape != keep.shape or not np.isfinite(given).all():
            raise UserError(f"objective {objective.name!r} scored {given.shape} documents (or some not finite); the "
                            f"training split has {keep.shape[0]}", key="data.curriculum")
        score = given[keep]
    order = np.argsort(score, kind="stable").astype(np.int64)
    return Curriculum(order, options.curriculum_start, options.curriculum_steps, options.curriculum_pacing)
