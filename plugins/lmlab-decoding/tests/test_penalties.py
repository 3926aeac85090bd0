"""The repetition penalty and the n-gram ban equal transformers' logits processors
(``RepetitionPenaltyLogitsProcessor``, ``NoRepeatNGramLogitsProcessor``) row by row, for rows of
different lengths, penalties and sizes decided in one batch; greedy decoding with the ban never
repeats an n-gram."""

import random

import pytest
import torch

from lmlab.api import TokenRows
from lmlab_decoding.greedy import GreedyDecoder
from lmlab_decoding.penalties import PenaltyOptions, penalize

transformers = pytest.importorskip("transformers")


def histories(rng: random.Random, vocab: int) -> list[list[int]]:
    # Small vocabularies repeat n-grams often; one row is a single token, one never repeats.
    return [[rng.randrange(6) for _ in range(rng.randint(8, 30))] for _ in range(4)] + [[3], list(range(vocab))]


@pytest.mark.parametrize("seed", range(3))
def test_each_row_is_what_transformers_processors_make_of_it(seed):
    rng = random.Random(seed)
    V = 10
    seen = histories(rng, V)
    options = [PenaltyOptions(repetition_penalty=rng.choice([1.0, 1.3, 0.8]), no_repeat_ngram_size=rng.choice([0, 1, 2, 3]))
               for _ in seen]
    logits = torch.randn(len(seen), V, generator=torch.Generator().manual_seed(seed)) * 3
    ours = penalize(logits, TokenRows(options, [None] * len(seen), history=lambda: seen))
    for r, (h, o) in enumerate(zip(seen, options)):
        ids, expected = torch.tensor([h]), logits[r:r + 1].clone()
        if o.repetition_penalty != 1:
            expected = transformers.RepetitionPenaltyLogitsProcessor(o.repetition_penalty)(ids, expected)
        if o.no_repeat_ngram_size:
            expected = transformers.NoRepeatNGramLogitsProcessor(o.no_repeat_ngram_size)(ids, expected)
        assert torch.equal(ours[r], expected[0]), (r, h, o)


def test_neutral_values_and_no_history_leave_the_logits_alone():
    logits = torch.randn(2, 7)
    neutral = [PenaltyOptions()] * 2
    assert penalize(logits, TokenRows(neutral, [None, None], history=lambda: [[1, 1], [2]])) is logits
    asked = [PenaltyOptions(repetition_penalty=2.0)] * 2
    assert penalize(logits, TokenRows(asked, [None, None])) is logits


def test_greedy_with_the_ban_never_repeats_an_ngram():
    """A bigram model that loops ("1 2 3 1 2 3 ...") greedily; with no_repeat_ngram_size 3 it cannot."""
    V = 8
    table = torch.full((V, V), -5.0)
    for a in range(V):
        table[a, (a % 3) + 1] = 5.0  # 0→1, 1→2, 2→3, 3→1, ...

    decoder = GreedyDecoder(PenaltyOptions(no_repeat_ngram_size=3))
    seq = [0]
    for _ in range(20):
        rows = TokenRows([decoder.options], [None], history=lambda: [seq])
        seq.append(int(decoder.choose(table[seq[-1]][None], rows)[0]))
    grams = [tuple(seq[i:i + 3]) for i in range(len(seq) - 2)]
    assert len(grams) == len(set(grams))
    plain = GreedyDecoder()
    looped = [0]
    for _ in range(20):
        looped.append(int(plain.choose(table[looped[-1]][None], TokenRows([plain.options], [None]))[0]))
    assert len({tuple(looped[i:i + 3]) for i in range(len(looped) - 2)}) < len(looped) - 2
