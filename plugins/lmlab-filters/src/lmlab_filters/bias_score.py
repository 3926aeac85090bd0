"""Documents that tie a target group to an attribute more than the corpus does are down-weighted, not
deleted: "the nurse said she...", page after page.

Association is the co-occurrence bias of Bordia & Bowman 2019 ("Identifying and Reducing Gender Bias
in Word-Level Language Models", https://arxiv.org/abs/1904.03035): how much more often a group's
words occur within ``window`` words of an attribute term than that group's share of all group words
predicts. For group g and attribute a, with c(g, a) co-occurrences, c(a) those of every group and p(g)
the group's share of the corpus's group words, it is the log odds ratio

    log[(c(g, a) + s·p(g)) / (c(a) − c(g, a) + s·(1 − p(g)))] − log[p(g) / (1 − p(g))]

smoothed by ``smoothing`` (s) pseudo-co-occurrences spread by the corpus rates, so that one or two
co-occurrences in a document say little (with two groups at equal rates, one gives 1.10, three give
1.95, ten 3.04). With two groups it is log[P(a | g) / P(a | other)], Bordia & Bowman's score.

A document's score is the largest association of a pair that it contains and that the corpus already
leans toward: the pair has co-occurred ``min_count`` times and its corpus association is positive. So a
document that ties "nurse" to "he" in a corpus that ties it to "she" is never down-weighted (that would
strengthen the stereotype). Scores above ``threshold`` set the weight by ``curve``: points
(score, weight) joined by straight lines, flat beyond both ends.

Workers find the words and count each document's co-occurrences (its signature); the main process
scores the documents in corpus order against the corpus's counts so far, this document included, so
the first documents are judged on little evidence. The report at the end is over the whole corpus: the
strongest associations before and after weighting (the counts each document adds, times its weight).
"""

import math
from pathlib import Path

import numpy as np
from pydantic import field_validator, model_validator

from lmlab.api import Field, Filter, Options, Table
from lmlab_filters import bias_lexicon
from lmlab_filters.bias_lexicon import WORD


class BiasScoreOptions(Options):
    lexicon: Path | None = Field(None, help="a TOML file of [groups] and [attributes], each name = [words] "
                                            "(default: the shipped gendered words × occupations)")
    window: int = Field(10, ge=1, help="words either side of an attribute term within which a group word co-occurs")
    threshold: float = Field(1.5, ge=0, help="document score above which the curve down-weights it")
    curve: list[tuple[float, float]] = Field(
        [(1.5, 1.0), (3.0, 0.2)], help="(score, weight) points, scores increasing and weights in [0, 1], joined by "
                                       "straight lines: a document's weight above the threshold")
    smoothing: float = Field(1.0, gt=0, help="pseudo-co-occurrences spread by the corpus rates: how much evidence a "
                                             "document needs before its own association counts")
    min_count: int = Field(5, ge=1, help="co-occurrences in the corpus before a pair's association counts, and "
                                         "before it is reported")
    top: int = Field(10, ge=1, help="pairs in the association table lmlab prepare prints")

    @field_validator("lexicon")
    @classmethod
    def _readable_lexicon(cls, path: Path | None) -> Path | None:
        bias_lexicon.load(path)  # ValueError: missing, empty or malformed, named with the file
        return path

    @field_validator("curve")
    @classmethod
    def _valid_curve(cls, points: list[tuple[float, float]]) -> list[tuple[float, float]]:
        if not points:
            raise ValueError("the curve needs at least one (score, weight) point")
        for score, weight in points:
            if not 0.0 <= weight <= 1.0:
                raise ValueError(f"the point ({score}, {weight}) has a weight outside [0, 1]")
        if any(b[0] <= a[0] for a, b in zip(points, points[1:])):
            raise ValueError("the curve's scores must increase from point to point")
        return points

    @model_validator(mode="after")
    def _curve_past_threshold(self) -> "BiasScoreOptions":
        if self.curve[-1][0] <= self.threshold:
            raise ValueError(f"curve: every point is at or below threshold = {self.threshold}, so it would set "
                             "no weight; put points above it")
        return self


def log_odds(near: np.ndarray, total: np.ndarray, p: np.ndarray, s: float) -> np.ndarray:
    """The smoothed association of each group (rows) with each attribute (columns): ``near`` their
    co-occurrences, ``total`` each attribute's co-occurrences with any group, ``p`` each group's share."""
    p = p[:, None]
    return np.log((near + s * p) / (total[None, :] - near + s * (1 - p))) - np.log(p / (1 - p))


class BiasScore(Filter):
    """``bias-score``: down-weights documents that tie a target group to an attribute term (gendered
    words and occupations by default) more strongly than the corpus's rates."""

    Options = BiasScoreOptions
    api = ">=1.12,<2"  # Filter.report, Table; a weight from admit (1.11)
    corpus_level = True

    def __init__(self, options: BiasScoreOptions | None = None):
        super().__init__(options)
        self.lexicon = bias_lexicon.load(self.options.lexicon)
        g, a = len(self.lexicon.groups), len(self.lexicon.attributes)
        # The corpus so far (main process): group words, and co-occurrences, as read and as weighted.
        self.group_words = np.zeros(g, np.int64)
        self.group_words_weighted = np.zeros(g)
        self.near = np.zeros((g, a), np.int64)
        self.near_weighted = np.zeros((g, a))
        self.documents = 0
        self.downweighted = 0

    # -- workers -----------------------------------------------------------------------------------

    def signature(self, text: str) -> tuple[tuple[int, ...], tuple[tuple[int, int, int], ...]]:
        """The document's group-word counts, and (group, attribute, co-occurrences) for each pair
        that co-occurs within the window."""
        lexicon, w = self.lexicon, self.options.window
        positions: tuple[dict, dict] = ({}, {})
        for i, word in enumerate(WORD.findall(text.lower())):
            hit = lexicon.index.get(word)
            if hit is not None:
                positions[hit[0]].setdefault(hit[1], []).append(i)
        counts = [0] * len(lexicon.groups)
        for g, at in positions[0].items():
            counts[g] = len(at)
        pairs = []
        for a, at_a in sorted(positions[1].items()):
            starts, ends = np.asarray(at_a) - w, np.asarray(at_a) + w
            for g, at_g in sorted(positions[0].items()):
                at_g = np.asarray(at_g)  # increasing, as read
                n = int((np.searchsorted(at_g, ends, "right") - np.searchsorted(at_g, starts, "left")).sum())
                if n:
                    pairs.append((g, a, n))
        return tuple(counts), tuple(pairs)

    # -- main process ------------------------------------------------------------------------------

    def score(self, signature) -> float:
        """The document's score against the corpus so far, this document included; changes nothing."""
        counts, pairs = signature
        if not pairs:
            return 0.0
        near = np.zeros_like(self.near)
        for g, a, n in pairs:
            near[g, a] = n
        o = self.options
        group_words = self.group_words + np.asarray(counts)
        p = self._shares(group_words)
        corpus = self.near + near
        leaning = (corpus >= o.min_count) & (log_odds(corpus, corpus.sum(0), p, o.smoothing) > 0) & (near > 0)
        if not leaning.any():
            return 0.0
        own = log_odds(near, near.sum(0), p, o.smoothing)
        return max(0.0, float(own[leaning].max()))

    def weight(self, score: float) -> float:
        """The sampling weight of a document with this score."""
        o = self.options
        if score <= o.threshold:
            return 1.0
        xs, ys = zip(*o.curve)
        return float(np.interp(score, xs, ys))

    def admit(self, signature) -> float:
        weight = self.weight(self.score(signature))
        counts, pairs = signature
        self.group_words += counts
        self.group_words_weighted += np.asarray(counts) * weight
        for g, a, n in pairs:
            self.near[g, a] += n
            self.near_weighted[g, a] += n * weight
        self.documents += 1
        if pairs:
            self.count("with_pairs")
        if weight < 1.0:
            self.downweighted += 1
            self.count("downweighted")
        return weight

    def _shares(self, group_words: np.ndarray) -> np.ndarray:
        # Laplace's rule: no group word seen yet is an equal share each, never 0 or 1.
        return (group_words + 1.0) / (group_words.sum() + len(group_words))

    def associations(self, weighted: bool = False) -> np.ndarray:
        """The corpus association of every (group, attribute) pair, as read or as weighted."""
        near = self.near_weighted if weighted else self.near.astype(float)
        groups = self.group_words_weighted if weighted else self.group_words
        return log_odds(near, near.sum(0), self._shares(groups), self.options.smoothing)

    def report(self) -> list[Table]:
        o = self.options
        before, after = self.associations(), self.associations(weighted=True)
        shares = self.group_words / max(1, self.group_words.sum())
        ranked = sorted(((before[g, a], g, a) for g, a in zip(*np.nonzero(self.near >= o.min_count))
                         if before[g, a] > 0), reverse=True)[:o.top]
        rows = []
        for assoc, g, a in ranked:
            near_a, near_wa = self.near[:, a].sum(), self.near_weighted[:, a].sum()
            rows.append((self.lexicon.groups[g], self.lexicon.attributes[a], int(self.near[g, a]),
                         _r(self.near[g, a] / near_a), _r(shares[g]), _r(assoc),
                         _r(self.near_weighted[g, a]), _r(self.near_weighted[g, a] / near_wa if near_wa else 0.0),
                         _r(after[g, a])))
        note = (f"share near: the group's share of group words within {o.window} words of the attribute; group "
                f"share: its share of all {int(self.group_words.sum()):,} group words; association: the log "
                f"odds ratio of the two (smoothing {o.smoothing:g}); after: each document's counts times its "
                f"weight. {self.downweighted:,} of {self.documents:,} documents down-weighted.")
        return [Table("bias-score: strongest group-attribute associations, before and after weighting",
                      ("group", "attribute", "co-occurrences", "share near", "group share", "association",
                       "weighted", "share near after", "association after"), tuple(rows), note)]

    # -- checkpoints -------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"groups": list(self.lexicon.groups), "attributes": list(self.lexicon.attributes),
                "group_words": self.group_words, "group_words_weighted": self.group_words_weighted,
                "near": self.near, "near_weighted": self.near_weighted,
                "documents": self.documents, "downweighted": self.downweighted}

    def load_state_dict(self, state: dict) -> None:
        if state.get("groups") != list(self.lexicon.groups) or state.get("attributes") != list(self.lexicon.attributes):
            raise ValueError("the checkpoint was made with another lexicon")
        for key in ("group_words", "group_words_weighted", "near", "near_weighted"):
            value = np.asarray(state[key])
            if value.shape != getattr(self, key).shape:
                raise ValueError(f"the checkpoint's {key} has shape {value.shape}")
            setattr(self, key, value.astype(getattr(self, key).dtype))
        self.documents, self.downweighted = int(state["documents"]), int(state["downweighted"])


def _r(x: float) -> float:
    """Four decimals in the JSON copy of the table: enough to compare, short to read."""
    return round(float(x), 4) if math.isfinite(x) else 0.0
