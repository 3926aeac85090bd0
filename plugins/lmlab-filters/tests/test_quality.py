"""Each quality rule drops a document past its threshold, keeps one within it, and 0 switches it off."""

import pytest

from lmlab.testing import check_plugin_class
from lmlab_filters.quality import Quality

PROSE = ("The quick brown fox jumps over the lazy dog while the farmer watches from his porch. " * 3).split()


def text_of(n_words: int) -> str:
    words = [f"{PROSE[i % len(PROSE)]}{i}" for i in range(n_words)]  # distinct lines, ordinary words
    return "\n".join(" ".join(words[i:i + 10]) for i in range(0, n_words, 10))


def rule(text: str, **options) -> str | None:
    return Quality(Quality.Options(**options)).failed_rule(text)


def test_meets_the_plugin_contract():
    check_plugin_class(Quality, "filter")


def test_ordinary_prose_passes_the_gopher_defaults():
    assert rule(text_of(200)) is None


def test_word_count_limits():
    assert rule(text_of(49)) == "too_few_words"
    assert rule(text_of(50)) is None
    assert rule(text_of(120), max_words=100) == "too_many_words"
    assert rule(text_of(10), min_words=0) is None


def test_mean_word_length_limits():
    assert rule(" ".join(["a b"] * 60)) == "short_words"
    assert rule(" ".join(["incomprehensibilities"] * 60), max_duplicate_line_fraction=0) == "long_words"
    assert rule(" ".join(["a b"] * 60), min_mean_word_length=0, min_alpha_word_fraction=0) is None


def test_symbol_to_word_ratio():
    words = text_of(100).split()
    hashes = " ".join(words[:80] + ["#"] * 11)  # 11 symbols in 91 words: 0.12 > 0.1
    assert rule(hashes) == "symbols_per_word"
    assert rule(hashes, max_symbol_word_ratio=0.2) is None


def test_share_of_words_with_a_letter():
    numbers = text_of(70) + "\n" + " ".join(str(i) for i in range(30))  # 70 % of words have a letter
    assert rule(numbers) == "words_without_letters"
    assert rule(numbers, min_alpha_word_fraction=0.7) is None


def test_symbol_fraction_is_off_unless_set():
    junk = text_of(60) + "\n" + "}{ ][ )( *& ^% $" * 40
    assert rule(junk, max_symbol_word_ratio=0, min_alpha_word_fraction=0) is None
    assert rule(junk, max_symbol_word_ratio=0, min_alpha_word_fraction=0, max_symbol_fraction=0.3) == "symbols"


def test_repeated_lines():
    lines = text_of(100).splitlines()  # 10 distinct lines
    repeated = "\n".join(lines + lines[:5])  # 5 of 15 lines repeat: 0.33 > 0.3
    assert rule(repeated) == "duplicate_lines"
    assert rule(repeated, max_duplicate_line_fraction=0.4, max_duplicate_line_char_fraction=0.4) is None
    assert rule(repeated, max_duplicate_line_fraction=0.4) == "duplicate_line_characters"


def test_dropped_documents_are_counted_by_rule():
    f = Quality()
    assert not f.keep("too short")
    assert f.keep(text_of(100))
    assert f.__dict__["_counts"] == {"too_few_words": 1}


@pytest.mark.parametrize("option", ["min_alpha_word_fraction", "max_symbol_fraction"])
def test_fractions_above_one_are_refused(option):
    with pytest.raises(ValueError, match=option):
        Quality.Options(**{option: 1.5})
