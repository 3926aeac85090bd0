"""Heuristic quality rules: length, symbols and repetition, after Gopher's MassiveText filters.

Rae et al. 2021 ("Scaling Language Models: Methods, Analysis & Insights from Training Gopher",
https://arxiv.org/abs/2112.11446, appendix A.1.1) keep a web document only if it has 50 to 100,000
words with a mean length of 3 to 10 characters, at most 0.1 symbols ("#" or an ellipsis) per word,
and at least 80 % of its words containing a letter; and drop documents that repeat themselves, among
other rules when over 30 % of the lines are duplicates or over 20 % of the characters sit in
duplicate lines. Those are the defaults here: they are tuned for prose, so source code, tables and
lists need other thresholds (``min_alpha_word_fraction`` in particular). A threshold of 0 switches its
rule off. Words are whitespace-separated tokens; lines are non-blank lines, compared without their
leading and trailing whitespace.

``max_symbol_fraction`` (off by default, not a Gopher rule) bounds the share of non-space characters
that are neither letters nor digits, which catches binary junk, ASCII art and minified code.

A dropped document is counted under the first rule it fails (``too_few_words``, ``duplicate_lines``,
...) in the filter's report.
"""

import re

from lmlab.api import Field, Filter, Options

WORD_WITH_LETTER = re.compile(r"\S*[^\W\d_]\S*")  # a maximal non-space run containing a letter
SYMBOL = re.compile(r"[^\w\s]|_")  # neither letter, digit nor space
SPACE = re.compile(r"\s")


class QualityOptions(Options):
    min_words: int = Field(50, ge=0, help="fewest words a document may have (0: no minimum)")
    max_words: int = Field(100_000, ge=0, help="most words a document may have (0: no maximum)")
    min_mean_word_length: float = Field(3.0, ge=0, help="lowest mean word length in characters (0: off)")
    max_mean_word_length: float = Field(10.0, ge=0, help="highest mean word length in characters (0: off)")
    max_symbol_word_ratio: float = Field(0.1, ge=0, help="most '#' and ellipses ('...', '…') per word (0: off)")
    min_alpha_word_fraction: float = Field(0.8, ge=0, le=1, help="least share of words that contain a letter "
                                                                 "(0: off)")
    max_symbol_fraction: float = Field(0.0, ge=0, le=1, help="most share of non-space characters that are "
                                                             "neither letters nor digits (0: off)")
    max_duplicate_line_fraction: float = Field(0.3, ge=0, le=1, help="most share of lines that repeat an "
                                                                     "earlier line (0: off)")
    max_duplicate_line_char_fraction: float = Field(0.2, ge=0, le=1, help="most share of the lines' characters "
                                                                          "in repeated lines (0: off)")


class Quality(Filter):
    """``quality``: drops documents that fail a length, symbol or repetition rule."""

    Options = QualityOptions
    api = ">=1.3,<2"  # lmlab.api.Filter

    def keep(self, text: str) -> bool:
        failed = self.failed_rule(text)
        if failed:
            self.count(failed)
        return failed is None

    def failed_rule(self, text: str) -> str | None:
        """The first rule ``text`` fails, or None."""
        o = self.options
        words = text.split()
        n = len(words)
        if n < o.min_words:
            return "too_few_words"
        if o.max_words and n > o.max_words:
            return "too_many_words"
        if n:
            mean = sum(map(len, words)) / n
            if mean < o.min_mean_word_length:
                return "short_words"
            if o.max_mean_word_length and mean > o.max_mean_word_length:
                return "long_words"
            if o.max_symbol_word_ratio:
                symbols = text.count("#") + text.count("...") + text.count("…")
                if symbols / n > o.max_symbol_word_ratio:
                    return "symbols_per_word"
            if o.min_alpha_word_fraction and _count(WORD_WITH_LETTER, text) / n < o.min_alpha_word_fraction:
                return "words_without_letters"
        if o.max_symbol_fraction:
            visible = len(text) - _count(SPACE, text)
            if visible and _count(SYMBOL, text) / visible > o.max_symbol_fraction:
                return "symbols"
        if o.max_duplicate_line_fraction or o.max_duplicate_line_char_fraction:
            lines = [line.strip() for line in text.splitlines() if line.strip()]
            seen: set[str] = set()
            duplicate_lines = duplicate_chars = 0
            for line in lines:
                if line in seen:
                    duplicate_lines += 1
                    duplicate_chars += len(line)
                seen.add(line)
            if lines and o.max_duplicate_line_fraction and duplicate_lines / len(lines) > o.max_duplicate_line_fraction:
                return "duplicate_lines"
            total = sum(map(len, lines))
            if total and o.max_duplicate_line_char_fraction and \
                    duplicate_chars / total > o.max_duplicate_line_char_fraction:
                return "duplicate_line_characters"
        return None


def _count(pattern: re.Pattern, text: str) -> int:
    return pattern.subn("", text)[1]  # counts in C, without a list of matches
