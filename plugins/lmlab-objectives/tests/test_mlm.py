"""Properties of the ``mlm`` objective: BERT's choice and 80/10/10 replacement, span masking, region
rates inside fenced code, reproducible draws, and the loss over chosen positions only."""

import math

import numpy as np
import pytest
import torch

from lmlab.api import IGNORE_INDEX, Batch, TokenSplit, UserError, Vocabulary, Windows
from lmlab_objectives.mlm import MLM, code_regions, find_fences, span_survival, start_probability

V = 50  # the tokenizer's ids; [MASK] is V, reserved past them
VOCAB = Vocabulary(size=V + 1, tokenizer_size=V, special={"mask": V})


def objective(**options) -> MLM:
    mlm = MLM(MLM.Options(**options))
    mlm.setup(VOCAB)
    return mlm


def windows(rows=64, length=129, seed=0, **fields) -> Windows:
    tokens = torch.randint(0, V, (rows, length), generator=torch.Generator().manual_seed(seed + 1000))
    return Windows(tokens, seed=seed, **fields)


def binomial_tolerance(p: float, n: float, sigmas: float = 5) -> float:
    return sigmas * math.sqrt(p * (1 - p) / n)


def test_targets_are_the_original_tokens_exactly_where_chosen_and_ignored_elsewhere():
    w = windows()
    batch = objective().make_batch_from(w)
    tokens = w.tokens[:, :-1]
    chosen = batch.targets != IGNORE_INDEX
    assert batch.input_ids.shape == batch.targets.shape == tokens.shape  # aligned, not shifted
    assert torch.equal(batch.targets[chosen], tokens[chosen])
    assert torch.equal(batch.input_ids[~chosen], tokens[~chosen])  # nothing unchosen is touched
    assert chosen.any() and not chosen.all()


def test_chosen_positions_are_80_percent_mask_10_random_10_unchanged():
    w = windows(rows=512, length=257)
    batch = objective().make_batch_from(w)
    chosen = batch.targets != IGNORE_INDEX
    n = chosen.sum().item()
    inputs, originals = batch.input_ids[chosen], batch.targets[chosen]
    masked = (inputs == V).float().mean().item()
    unchanged = (inputs == originals).float().mean().item()
    # a random replacement equals the original with probability 1/V
    assert masked == pytest.approx(0.8, abs=binomial_tolerance(0.8, n))
    assert unchanged == pytest.approx(0.1 + 0.1 / V, abs=binomial_tolerance(0.1, n))
    assert (inputs < V).all() or (inputs[inputs != V] < V).all()  # random ids come from the tokenizer's range


@pytest.mark.parametrize("rate", [0.15, 0.4])
def test_token_masking_realises_the_mask_rate(rate):
    n = 512 * 256
    batch = objective(mask_rate=rate).make_batch_from(windows(rows=512, length=257))
    realised = (batch.targets != IGNORE_INDEX).float().mean().item()
    assert realised == pytest.approx(rate, abs=binomial_tolerance(rate, n))


@pytest.mark.parametrize("span_mean, span_max, rate", [(5, 10, 0.15), (3, 8, 0.5), (2, 4, 0.9)])
def test_span_masking_realises_the_mask_rate_at_every_position(span_mean, span_max, rate):
    batch = objective(mask_rate=rate, span_mean=span_mean, span_max=span_max).make_batch_from(
        windows(rows=2048, length=65))
    chosen = (batch.targets != IGNORE_INDEX).float()
    # Spans correlate neighbouring positions: count rows (independent) rather than tokens for the
    # overall rate, and check the first positions of a row are covered as often as the others.
    assert chosen.mean().item() == pytest.approx(rate, abs=binomial_tolerance(rate, 2048 * 64 / span_max))
    per_position = chosen.mean(dim=0)  # (T,)
    assert per_position[:span_max].mean().item() == pytest.approx(rate, abs=binomial_tolerance(rate, 2048 * 2))


def test_span_lengths_follow_the_clipped_geometric_distribution():
    batch = objective(mask_rate=0.03, span_mean=4, span_max=10).make_batch_from(windows(rows=1024, length=257))
    chosen = (batch.targets != IGNORE_INDEX).numpy().astype(np.int8)
    edges = np.diff(np.pad(chosen, ((0, 0), (1, 1))), axis=1)
    starts, ends = np.nonzero(edges == 1), np.nonzero(edges == -1)
    interior = (starts[1] > 0) & (ends[1] < chosen.shape[1])  # runs not cut by the window's edges
    lengths = (ends[1] - starts[1])[interior]
    expected = span_survival(4, 10).sum()  # E[min(Geo(1/4), 10)] = Σ_d P(ℓ > d) = 3.775
    # At a 3 % rate few spans touch, so runs are mostly single spans (touching ones make runs a bit longer).
    assert lengths.mean() == pytest.approx(expected, rel=0.06)
    assert lengths.max() <= 2 * 10 + 5 and np.mean(lengths <= 10) > 0.97


def test_span_replacement_is_decided_per_span():
    batch = objective(mask_rate=0.03, span_mean=4, span_max=10).make_batch_from(windows(rows=512, length=257))
    chosen = batch.targets != IGNORE_INDEX
    masked = (batch.input_ids == V) & chosen
    # Neighbouring chosen positions belong to one span almost always here: they agree on [MASK] or not.
    both = chosen[:, 1:] & chosen[:, :-1]
    agree = (masked[:, 1:] == masked[:, :-1])[both].float().mean().item()
    assert agree > 0.95


def test_start_probability_makes_overlapping_spans_cover_the_rate():
    for span_mean, span_max in ((1, 10), (5, 10), (3, 4)):
        survival = span_survival(span_mean, span_max)
        for rate in (0.05, 0.15, 0.5, 0.9, 1.0):
            q = start_probability(rate, survival)
            assert 1 - np.prod(1 - q * survival) == pytest.approx(rate, abs=1e-9)
    assert start_probability(0.15, span_survival(1, 10)) == pytest.approx(0.15)


def test_draws_are_a_function_of_the_batch_seed():
    a, b = objective(span_mean=3), objective(span_mean=3)
    tokens = windows(rows=8).tokens
    first, again = a.make_batch_from(Windows(tokens, seed=7)), b.make_batch_from(Windows(tokens, seed=7))
    other = a.make_batch_from(Windows(tokens, seed=8))
    assert torch.equal(first.input_ids, again.input_ids) and torch.equal(first.targets, again.targets)
    assert not torch.equal(first.targets, other.targets)


def test_a_replica_gets_its_rows_of_the_global_batch_draws():
    mlm = objective(span_mean=3, code_mask_rate=0.9)
    whole = windows(rows=8, seed=3)
    whole.labels = (torch.rand(8, 129, generator=torch.Generator().manual_seed(0)) < 0.5).to(torch.uint8)
    full = mlm.make_batch_from(Windows(whole.tokens, labels=whole.labels, seed=3))
    for replica in (0, 1):
        rows = slice(4 * replica, 4 * replica + 4)
        part = mlm.make_batch_from(Windows(whole.tokens[rows], labels=whole.labels[rows], seed=3,
                                           first_row=4 * replica, total_rows=8))
        assert torch.equal(part.input_ids, full.input_ids[rows]) and torch.equal(part.targets, full.targets[rows])


def test_loss_is_the_cross_entropy_over_chosen_positions_only():
    w = windows(rows=4, length=33)
    mlm = objective(z_loss=0.0)
    batch = mlm.make_batch_from(w)
    logits = torch.randn(4, 32, V + 1, generator=torch.Generator().manual_seed(5)) * 2
    chosen = batch.targets != IGNORE_INDEX
    log_probs = logits.double().log_softmax(-1)
    by_hand = -log_probs[chosen].gather(-1, batch.targets[chosen][:, None]).mean()
    loss = mlm.loss(logits, batch)
    assert loss.item() == pytest.approx(by_hand.item(), rel=1e-6)
    changed = logits.clone()
    changed[~chosen] = torch.randn_like(changed[~chosen]) * 10  # logits at unchosen positions do not matter
    assert mlm.loss(changed, batch).item() == pytest.approx(loss.item(), rel=1e-6)
    nothing = Batch(batch.input_ids, torch.full_like(batch.targets, IGNORE_INDEX))
    assert mlm.loss(logits, nothing).item() == 0.0  # no chosen position: zero, not NaN


class Chars:
    """A character tokenizer over a fixed alphabet, as token_labels sees the run's tokenizer."""

    def __init__(self, alphabet: str):
        self.alphabet = alphabet

    def encode(self, text: str) -> np.ndarray:
        if any(c not in self.alphabet for c in text):
            raise UserError("unknown character", key="tokenizer.unknown")
        return np.array([self.alphabet.index(c) for c in text], dtype=np.int64)


ALPHABET = "`abcdefgh \n"


def split_of(documents: list[str]) -> TokenSplit:
    tok = Chars(ALPHABET)
    ids = [tok.encode(d) for d in documents]
    starts = np.cumsum([0] + [len(i) for i in ids[:-1]])
    return TokenSplit("train", np.concatenate(ids).astype(np.uint16), None, starts, tok)


def reference_regions(documents: list[str], fence: str = "```") -> np.ndarray:
    """Per character, 1 inside a fenced block: a plain scan of each document on its own."""
    out = []
    for doc in documents:
        inside, i, marks = False, 0, [0] * len(doc)
        while i < len(doc):
            if doc.startswith(fence, i) and (i == 0 or doc[i - 1] != "`"):
                inside = not inside
                i += len(fence)
                while i < len(doc) and doc[i] == "`":  # a longer run of backticks is one fence
                    i += 1
                continue
            marks[i] = int(inside)
            i += 1
        out.extend(marks)
    return np.array(out, dtype=np.uint8)


def random_documents(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(n):
        parts = []
        for _ in range(rng.integers(1, 6)):
            parts.append("".join(rng.choice(list("abcdefgh \n"), size=rng.integers(0, 30))))
            parts.append("`" * int(rng.choice([3, 3, 3, 4, 1, 2])))
        docs.append("".join(parts))
    return docs


def test_code_regions_match_a_scan_of_each_document_and_reset_at_document_starts():
    docs = random_documents(300, seed=0)
    docs[5] = "ab```cd"  # an unclosed fence: the next document starts outside
    split = split_of(docs)
    regions = objective(code_mask_rate=0.9).token_labels(split)
    n = len(split.tokens)
    positions = np.arange(n).reshape(1, n)
    np.testing.assert_array_equal(regions(positions)[0], reference_regions(docs))
    # any shape of positions, in any order (windows cross documents anywhere)
    scattered = np.random.default_rng(1).integers(0, n, size=(7, 33))
    np.testing.assert_array_equal(regions(scattered), reference_regions(docs)[scattered])


def test_fences_are_found_across_scan_chunks(monkeypatch):
    import lmlab_objectives.mlm as mlm_module

    docs = random_documents(50, seed=2)
    split = split_of(docs)
    starts, ends = find_fences(split.tokens, np.zeros(3, np.int64), split.document_starts)
    assert len(starts) > 50 and (ends - starts >= 3).all() and (starts[1:] > ends[:-1]).all()
    monkeypatch.setattr(mlm_module, "CHUNK", 7)  # a fence now often straddles two chunks
    chunked = find_fences(split.tokens, np.zeros(3, np.int64), split.document_starts)
    np.testing.assert_array_equal(chunked[0], starts)
    np.testing.assert_array_equal(chunked[1], ends)


def test_no_code_mask_rate_or_no_fence_in_the_vocabulary_means_no_labels():
    split = split_of(["ab```cd```"])
    assert objective().token_labels(split) is None
    no_backticks = TokenSplit("train", np.zeros(5, np.uint16), None, np.zeros(1, np.int64), Chars("ab"))
    assert objective(code_mask_rate=0.9).token_labels(no_backticks) is None


@pytest.mark.parametrize("span_mean", [1, 3])
def test_region_rates_are_code_mask_rate_inside_fences_and_mask_rate_outside(span_mean):
    # Long blocks and long prose, so that spans crossing a boundary are rare.
    docs = ["abc " * 60 + "```\n" + "def " * 60 + "```\n" + "hgf " * 60 for _ in range(40)]
    split = split_of(docs)
    mlm = objective(mask_rate=0.15, code_mask_rate=0.9, span_mean=span_mean, span_max=6)
    regions = mlm.token_labels(split)
    rng = np.random.default_rng(0)
    inside_hits = outside_hits = inside_n = outside_n = 0
    for step in range(40):
        starts = rng.integers(0, len(split.tokens) - 129, size=64)
        positions = starts[:, None] + np.arange(129)
        tokens = torch.from_numpy(split.tokens[positions].astype(np.int64))
        labels = torch.from_numpy(regions(positions))
        batch = mlm.make_batch_from(Windows(tokens, labels=labels, seed=step))
        chosen = batch.targets != IGNORE_INDEX
        code = labels[:, :-1].bool()
        inside_hits += chosen[code].sum().item()
        inside_n += code.sum().item()
        outside_hits += chosen[~code].sum().item()
        outside_n += (~code).sum().item()
    assert inside_n > 50_000 and outside_n > 100_000
    # spans correlate up to span_max neighbours: count effective samples accordingly
    assert inside_hits / inside_n == pytest.approx(0.9, abs=binomial_tolerance(0.9, inside_n / 6) + 0.01)
    assert outside_hits / outside_n == pytest.approx(0.15, abs=binomial_tolerance(0.15, outside_n / 6) + 0.01)


def test_fractions_that_add_up_to_more_than_one_are_refused():
    with pytest.raises(UserError) as info:
        MLM(MLM.Options(mask_fraction=0.8, random_fraction=0.3))
    assert info.value.key == "objective.random_fraction"


def test_mlm_declares_a_bidirectional_model_with_a_mask_token():
    assert MLM.causal is False and MLM.special_tokens == ("mask",) and MLM.wants_windows()


def test_a_corpus_without_the_fence_has_no_fences():
    starts, ends = find_fences(np.array([1, 2, 3, 4, 5]), np.array([9, 9, 9]), np.array([0]))
    assert starts.tolist() == ends.tolist() == []
