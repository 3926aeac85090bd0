"""bias-score: co-occurrence counts against a brute-force count, the association against its closed
form, a planted stereotype scored above neutral text and weakened in the corpus after weighting, the
weight curve, resumable state, the report through ``lmlab prepare``, and bad lexicons and curves."""

import json
import math
import random

import numpy as np
import pytest

from lmlab.testing import check_filter
from lmlab.testing.runs import main
from lmlab_filters.bias_lexicon import WORD
from lmlab_filters.bias_score import BiasScore

FILLER = ("the river ran past the old mill and the fields were green with barley while rain came in from the "
          "west over the hills and the road was long").split()
NEUTRAL_WORDS = ("he", "she", "him", "her", "nurse", "engineer", "teacher", "doctor")


def make(**options) -> BiasScore:
    return BiasScore(BiasScore.Options(**options))


def prose(rng: random.Random, n: int, extra: tuple = ()) -> str:
    """Filler text with the words of ``extra`` scattered through it."""
    words = [rng.choice(FILLER) for _ in range(n)]
    for word in extra:
        words.insert(rng.randrange(len(words) + 1), word)
    return " ".join(words)


def background(rng: random.Random, n_docs: int = 200) -> list[str]:
    """Documents where each gendered word meets each occupation about equally often."""
    return [prose(rng, 60, tuple(rng.choice(NEUTRAL_WORDS) for _ in range(6))) for _ in range(n_docs)]


STEREOTYPED = ("The nurse said she would stay. She is a nurse, and her sister, a nurse too, said she "
               "and her mother were nurses before her.")
NEUTRAL = "The nurse said he would stay, and she agreed. The nurse and her brother, he said, would come."


def brute_force(filt: BiasScore, text: str) -> dict:
    """(group, attribute) → co-occurrences, counted pair of positions by pair of positions."""
    words = WORD.findall(text.lower())
    hits = [(i, filt.lexicon.index.get(w)) for i, w in enumerate(words)]
    groups = [(i, h[1]) for i, h in hits if h and h[0] == 0]
    attrs = [(i, h[1]) for i, h in hits if h and h[0] == 1]
    out: dict = {}
    for i, a in attrs:
        for j, g in groups:
            if abs(i - j) <= filt.options.window:
                out[g, a] = out.get((g, a), 0) + 1
    return out


@pytest.mark.parametrize("window", [1, 3, 10])
def test_cooccurrence_counts_equal_a_brute_force_count(window):
    filt, rng = make(window=window), random.Random(window)
    for _ in range(30):
        text = prose(rng, 80, tuple(rng.choice(NEUTRAL_WORDS + ("surgeon", "Queen", "SIR")) for _ in range(15)))
        counts, pairs = filt.signature(text)
        assert {(g, a): n for g, a, n in pairs} == brute_force(filt, text)
        words = WORD.findall(text.lower())
        expected = [sum(filt.lexicon.index.get(w) == (0, g) for w in words) for g in range(len(counts))]
        assert list(counts) == expected


def test_association_is_the_log_ratio_of_conditional_rates_with_two_groups():
    # Without smoothing (s → 0), the log odds ratio is log[P(a | f) / P(a | m)] (Bordia & Bowman's score).
    filt = make(smoothing=1e-9)
    f, m = filt.lexicon.groups.index("female"), filt.lexicon.groups.index("male")
    nurse = filt.lexicon.attributes.index("nurse")
    filt.group_words[:] = 0
    filt.group_words[[f, m]] = (400, 1200)
    filt.near[f, nurse], filt.near[m, nurse] = 30, 10
    expected = math.log((30 / 401) / (10 / 1201))  # the shares are Laplace-smoothed: +1 per group
    assert filt.associations()[f, nurse] == pytest.approx(expected, rel=1e-6)
    assert filt.associations()[m, nurse] == pytest.approx(-expected, rel=1e-6)


def test_a_planted_stereotype_scores_above_neutral_text_and_above_the_threshold():
    filt = BiasScore()
    for text in background(random.Random(0)):
        filt.admit(filt.signature(text))
    for _ in range(5):  # the corpus leans: nurse ~ female
        filt.admit(filt.signature(STEREOTYPED))
    planted, neutral = filt.score(filt.signature(STEREOTYPED)), filt.score(filt.signature(NEUTRAL))
    assert planted > filt.options.threshold > neutral
    assert filt.weight(planted) < 1.0 == filt.weight(neutral)
    # Text with no group word near an attribute has no association at all.
    assert filt.score(filt.signature("The engineer fixed the mill.")) == 0.0


def test_text_that_counters_the_corpus_lean_is_never_downweighted():
    filt = BiasScore()
    for _ in range(10):
        filt.admit(filt.signature(STEREOTYPED))
    counter = STEREOTYPED.replace("she", "he").replace("her sister", "his brother").replace("her mother", "his father")
    counter = counter.replace("She", "He").replace("before her", "before him")
    assert filt.score(filt.signature(counter)) == 0.0


def test_weighting_lowers_the_corpus_association_of_the_planted_pair():
    rng = random.Random(1)
    corpus = background(rng, 300)
    for k in range(40):  # 40 stereotyped documents among 300
        corpus.insert(rng.randrange(len(corpus)), STEREOTYPED)
    filt = BiasScore()
    weights = [filt.admit(filt.signature(text)) for text in corpus]
    f, nurse = filt.lexicon.groups.index("female"), filt.lexicon.attributes.index("nurse")
    before, after = filt.associations()[f, nurse], filt.associations(weighted=True)[f, nurse]
    assert before > 1.0 and after < before - 0.5, (before, after)
    planted = [w for text, w in zip(corpus, weights) if text == STEREOTYPED]
    assert max(planted[5:]) < 0.5  # once the corpus leans, each copy weighs little
    others = [w for text, w in zip(corpus, weights) if text != STEREOTYPED]
    assert np.mean(others) > 0.95, np.mean(others)  # a chance pair or two costs the background little
    # The report leads with the planted pair and shows both figures.
    (table,) = filt.report()
    row = dict(zip(table.columns, table.rows[0]))
    assert (row["group"], row["attribute"]) == ("female", "nurse")
    assert row["association"] == pytest.approx(before, abs=1e-4)
    assert row["association after"] == pytest.approx(after, abs=1e-4)
    assert row["co-occurrences"] == filt.near[f, nurse]
    assert f"{filt.downweighted:,} of {len(corpus):,} documents down-weighted" in table.note


@pytest.mark.parametrize("score, weight", [(0.0, 1.0), (1.5, 1.0), (2.25, 0.6), (3.0, 0.2), (9.0, 0.2)])
def test_the_curve_interpolates_between_points_and_is_flat_beyond(score, weight):
    assert BiasScore().weight(score) == pytest.approx(weight)


def test_a_threshold_below_the_curve_uses_its_first_weight():
    filt = make(threshold=1.0, curve=[(2.0, 0.5), (4.0, 0.0)])
    assert filt.weight(1.0) == 1.0 and filt.weight(1.5) == 0.5 and filt.weight(3.0) == 0.25


def test_a_user_lexicon_replaces_the_shipped_one(tmp_path):
    path = tmp_path / "lexicon.toml"
    path.write_text('[groups]\nnorth = ["northerner", "northerners"]\nsouth = ["southerner"]\n\n'
                    '[attributes]\nthrifty = ["thrifty", "frugal"]\n')
    filt = make(lexicon=path)
    assert filt.lexicon.groups == ("north", "south") and filt.lexicon.attributes == ("thrifty",)
    assert filt.signature("A frugal northerner and a thrifty Northerner met a southerner.") == \
        ((2, 1), ((0, 0, 4), (1, 0, 2)))


def test_passes_the_filter_conformance_kit_on_gendered_text():
    rng = random.Random(2)
    documents = background(rng, 6) + [STEREOTYPED, NEUTRAL, STEREOTYPED, STEREOTYPED, "no words of the lexicon"]
    check_filter(BiasScore, {"min_count": 2}, documents=documents)


def test_a_checkpoint_resumes_with_the_same_weights():
    documents = background(random.Random(3), 100) + [STEREOTYPED] * 20
    random.Random(4).shuffle(documents)
    whole, first = BiasScore(), BiasScore()
    expected = [whole.admit(whole.signature(t)) for t in documents]
    for t in documents[:60]:
        first.admit(first.signature(t))
    resumed = BiasScore()
    resumed.load_state_dict(json.loads(json.dumps({k: v.tolist() if isinstance(v, np.ndarray) else v
                                                   for k, v in first.state_dict().items()})))
    assert [resumed.admit(resumed.signature(t)) for t in documents[60:]] == expected[60:]
    assert resumed.report() == whole.report()
    with pytest.raises(ValueError, match="another lexicon"):
        BiasScore().load_state_dict({**first.state_dict(), "groups": ["a", "b"]})


def manifest(tmp_path, table: str = "", corpus: str | None = None):
    (tmp_path / "c.txt").write_text(corpus if corpus is not None else "\n\n".join(
        background(random.Random(5), 300) + [STEREOTYPED] * 30))
    path = tmp_path / "m.toml"
    path.write_text(f'name = "bias"\n\n[data]\nuse = "text-file"\npath = "c.txt"\nseparator = "\\n\\n"\n\n'
                    f'[tokenizer]\nuse = "char"\n\n[tracker]\nuse = "none"\n\n'
                    f'[filter]\nuse = ["bias-score"]\n\n[filter.bias-score]\n{table}\n')
    return path


@pytest.mark.parametrize("workers", [1, 2])
def test_prepare_prints_the_table_and_keeps_it_in_the_index(tmp_path, monkeypatch, capsys, workers):
    monkeypatch.setenv("LMLAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    path = manifest(tmp_path)
    assert main(["prepare", str(path), "--workers", str(workers)]) == 0
    err = capsys.readouterr().err
    assert "bias-score: strongest group-attribute associations, before and after weighting" in err
    (index_path,) = (tmp_path / "cache" / "tokens").glob("*/index.json")
    stats = json.loads(index_path.read_text())["filters"]["bias-score"]
    (table,) = stats["tables"]
    first = dict(zip(table["columns"], table["rows"][0]))
    assert (first["group"], first["attribute"]) == ("female", "nurse")
    assert first["association after"] < first["association"] - 0.5
    assert stats["counts"]["downweighted"] >= 25 and stats["mean_weight"] < 1.0
    line = next(line for line in err.splitlines() if line.strip().startswith("female  nurse"))
    assert f"{first['association']:.3f}" in line and f"{first['association after']:.3f}" in line


def test_prepare_in_two_workers_equals_one(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    indexes = []
    for workers in (1, 2):
        monkeypatch.setenv("LMLAB_CACHE", str(tmp_path / f"cache{workers}"))
        assert main(["prepare", str(manifest(tmp_path)), "--workers", str(workers)]) == 0
        (index_path,) = (tmp_path / f"cache{workers}" / "tokens").glob("*/index.json")
        indexes.append(json.loads(index_path.read_text())["filters"])
    assert indexes[0] == indexes[1]


@pytest.mark.parametrize("table, key, says", [
    ('lexicon = "missing.toml"', "filter.bias-score.lexicon", "no such lexicon file"),
    ('lexicon = "empty.toml"', "filter.bias-score.lexicon", "the lexicon is empty"),
    ('lexicon = "one_group.toml"', "filter.bias-score.lexicon", "[groups] needs at least 2 entries"),
    ('lexicon = "twice.toml"', "filter.bias-score.lexicon", "'nurse' is also in groups.m"),
    ("curve = [[2.0, 1.5]]", "filter.bias-score.curve", "weight outside [0, 1]"),
    ("curve = [[2.0, 0.5], [3.0, -0.1]]", "filter.bias-score.curve", "weight outside [0, 1]"),
    ("curve = [[3.0, 0.5], [2.0, 0.1]]", "filter.bias-score.curve", "must increase"),
    ("threshold = 4.0", "filter.bias-score", "every point is at or below threshold"),
    ("window = 0", "filter.bias-score.window", "greater than or equal to 1"),
], ids=["missing", "empty", "one-group", "word-twice", "weight-above-1", "weight-below-0", "decreasing",
        "curve-below-threshold", "window"])
def test_bad_options_are_refused_by_check_naming_the_key(tmp_path, monkeypatch, capsys, table, key, says):
    monkeypatch.setenv("LMLAB_CACHE", str(tmp_path / "cache"))
    (tmp_path / "empty.toml").write_text("\n  \n")
    (tmp_path / "one_group.toml").write_text('[groups]\nf = ["she"]\n\n[attributes]\nnurse = ["nurse"]\n')
    (tmp_path / "twice.toml").write_text('[groups]\nf = ["she"]\nm = ["he", "nurse"]\n\n[attributes]\nnurse = ["nurse"]\n')
    path = manifest(tmp_path, table, corpus="a\n\nb\n")
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"lmlab: error: {key}") and says in err and err.count("\n") == 1, err
