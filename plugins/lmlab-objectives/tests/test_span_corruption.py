"""Properties of the ``span-corruption`` objective: T5's counts and uniformly random segmentation,
exact reconstruction of the row from encoder and decoder, lengths within the block, reproducible and
sliceable draws, the loss, and what is refused."""

from math import comb

import numpy as np
import pytest
import torch

from lmlab.api import CheckContext, ModelShape, Seq2SeqBatch, UserError, Vocabulary, Windows
from lmlab.testing.runs import main
from lmlab_objectives.span_corruption import SpanCorruption, span_counts

V = 1000                                 # the tokenizer's ids
EOS, START = 1, 0
# sentinel_i gets a shuffled id past the tokenizer's, so a test can tell the vocab's ids from V + i
SENTINEL_IDS = (V + torch.randperm(100, generator=torch.Generator().manual_seed(0))).tolist()
VOCAB = Vocabulary(size=V + 100, tokenizer_size=V, special={f"sentinel_{i}": s for i, s in enumerate(SENTINEL_IDS)},
                   eos_id=EOS, decoder_start_id=START)


def objective(vocab=VOCAB, **options) -> SpanCorruption:
    sc = SpanCorruption(SpanCorruption.Options(**options))
    sc.setup(vocab)
    return sc


def random_tokens(rows=64, length=129, seed=0) -> torch.Tensor:
    """Tokens of the tokenizer's range other than the end token (which may still be anywhere in a corpus;
    keeping it out lets the tests read the end of a sequence)."""
    return torch.randint(2, V, (rows, length), generator=torch.Generator().manual_seed(seed + 1000))


def distinct_tokens(rows: int, length: int) -> torch.Tensor:
    """Every token of every row different (and increasing along a row), none a sentinel's id."""
    return torch.arange(rows * length).view(rows, length) + 2 * V


def split_at_sentinels(sequence: list[int]) -> tuple[list[int], list[list[int]]]:
    """(the sentinels in order, the tokens behind each) of a sequence without its end token."""
    sentinels, pieces = [], []
    for t in sequence:
        if t in SENTINEL_IDS:
            sentinels.append(t)
            pieces.append([])
        elif pieces:
            pieces[-1].append(t)
    return sentinels, pieces


def segment_lengths(sequence: torch.Tensor, prefix: bool) -> torch.Tensor:
    """(B, S) lengths of the runs of non-sentinel tokens in ``sequence`` (B, D) (its end token dropped):
    the runs behind each sentinel, or, with ``prefix``, the runs before each."""
    body = sequence[:, :-1]
    B = body.shape[0]
    at = torch.isin(body, torch.tensor(SENTINEL_IDS)).nonzero()[:, 1].view(B, -1)        # (B, S) positions
    if prefix:
        return at.diff(dim=1, prepend=torch.full((B, 1), -1)) - 1
    return at.diff(dim=1, append=torch.full((B, 1), body.shape[1])) - 1


def composition_length_probabilities(items: int, segments: int) -> np.ndarray:
    """P(a given segment has length l), l = 1 .. items - segments + 1, when ``items`` are cut into
    ``segments`` non-empty segments, every cut equally likely: C(items-l-1, segments-2) / C(items-1, segments-1)."""
    lengths = np.arange(1, items - segments + 2)
    if segments == 1:
        return (lengths == items).astype(float)
    return np.array([comb(items - l - 1, segments - 2) / comb(items - 1, segments - 1) for l in lengths])


@pytest.mark.parametrize("density, mean, n, noise, spans", [
    (0.15, 3.0, 129, 19, 6),        # the defaults: the whole window fits
    (0.4, 2.0, 129, 52, 26),
    (0.3, 1.0, 127, 38, 38),        # the window does not fit whole: n is cut to the largest that does
])
def test_counts_and_span_lengths_follow_t5s_uniform_segmentation(density, mean, n, noise, spans):
    from scipy.stats import chisquare

    B, L = 4000, 129
    tokens = distinct_tokens(B, L)
    batch = objective(noise_density=density, mean_span_length=mean).make_batch_from(Windows(tokens, seed=11))
    kept = batch.encoder_ids[:, :-1]
    kept = kept[~torch.isin(kept, torch.tensor(SENTINEL_IDS))].view(B, -1)
    dropped = batch.targets[:, :-1]
    dropped = dropped[~torch.isin(dropped, torch.tensor(SENTINEL_IDS))].view(B, -1)
    # the first n tokens of each row, each either kept or dropped, and exactly round(n · density) dropped
    assert kept.shape[1] + dropped.shape[1] == n
    assert torch.equal(torch.cat([kept, dropped], 1).sort(1).values, tokens[:, :n])
    assert dropped.shape[1] == noise == round(n * density)

    noise_lengths, kept_lengths = segment_lengths(batch.targets, prefix=False), segment_lengths(batch.encoder_ids,
                                                                                               prefix=True)
    assert noise_lengths.shape == kept_lengths.shape == (B, spans)
    assert (noise_lengths >= 1).all() and (kept_lengths >= 1).all()
    assert (noise_lengths.sum(1) == noise).all() and (kept_lengths.sum(1) == n - noise).all()
    assert noise_lengths.float().mean().item() == pytest.approx(noise / spans)

    # One span per row (span r mod S of row r), so that the samples are independent, against the exact
    # distribution of a segment's length under uniformly random cuts.
    rows = torch.arange(B)
    for lengths, items in ((noise_lengths, noise), (kept_lengths, n - noise)):
        sample = lengths[rows, rows % spans].numpy()
        p = composition_length_probabilities(items, spans)
        assert sample.mean() == pytest.approx(items / spans, rel=0.05)
        if spans > 1:
            assert np.mean(lengths.numpy() == 1) == pytest.approx(p[0], abs=0.02)  # all spans: (S-1)/(items-1)
        expected = p * B
        keep = expected >= 5                                     # merge the sparse tail into one cell
        observed = np.bincount(sample - 1, minlength=len(p))[:len(p)]
        f_obs = np.append(observed[keep], observed[~keep].sum())
        f_exp = np.append(expected[keep], expected[~keep].sum())
        if f_exp[-1] == 0:
            f_obs, f_exp = f_obs[:-1], f_exp[:-1]
        if len(f_exp) == 1:                                     # one possible length (spans of one token)
            assert (sample == items // spans).all()
        else:
            assert chisquare(f_obs, f_exp).pvalue > 1e-3


@pytest.mark.parametrize("eos", [EOS, None])
@pytest.mark.parametrize("density, mean", [(0.15, 3.0), (0.4, 2.0), (0.9, 1.0)])
def test_sentinels_stand_for_the_spans_the_decoder_writes(eos, density, mean):
    vocab = Vocabulary(size=VOCAB.size, tokenizer_size=V, special=VOCAB.special, eos_id=eos, decoder_start_id=START)
    sc = objective(vocab, noise_density=density, mean_span_length=mean)
    tokens = random_tokens(rows=32, length=65)
    batch = sc.make_batch_from(Windows(tokens, seed=5))
    n = sc.layouts[65].n
    tail = 0 if eos is None else 1
    if eos is not None:
        assert (batch.encoder_ids[:, -1] == EOS).all() and (batch.targets[:, -1] == EOS).all()
    for row in range(tokens.shape[0]):
        encoder, targets = batch.encoder_ids[row].tolist(), batch.targets[row].tolist()
        encoder, targets = encoder[:len(encoder) - tail], targets[:len(targets) - tail]
        sentinels, spans = split_at_sentinels(targets)
        assert targets[0] == SENTINEL_IDS[0]                           # the decoder's sequence starts with one
        assert sentinels == SENTINEL_IDS[:len(sentinels)]              # sentinel_0, sentinel_1, ... in order
        assert all(spans)                                              # no empty span
        spans_of = dict(zip(sentinels, spans))
        rebuilt = [u for t in encoder for u in (spans_of[t] if t in spans_of else [t])]
        assert rebuilt == tokens[row, :n].tolist()
        assert encoder[-1] == sentinels[-1]                            # the row ends in a span, as in T5
        assert sum(t in spans_of for t in encoder) == len(sentinels)   # each sentinel once in the encoder


def test_decoder_reads_the_targets_shifted_right_behind_the_start_id():
    batch = objective().make_batch_from(Windows(random_tokens(), seed=2))
    assert isinstance(batch, Seq2SeqBatch) and batch.encoder_padding is None
    assert (batch.input_ids[:, 0] == START).all()
    assert torch.equal(batch.input_ids[:, 1:], batch.targets[:, :-1])
    assert batch.input_ids.shape == batch.targets.shape == (64, 19 + 6 + 1)
    assert batch.encoder_ids.shape == (64, 129 - 19 + 6 + 1)
    assert batch.model_inputs() == {"encoder_ids": batch.encoder_ids, "encoder_padding": None}
    assert batch.input_ids.dtype == batch.targets.dtype == batch.encoder_ids.dtype == torch.int64


@pytest.mark.parametrize("eos", [EOS, None])
@pytest.mark.parametrize("density, mean", [(0.15, 3.0), (0.5, 1.0), (0.05, 10.0), (0.95, 1.0), (0.99, 1.0)])
def test_every_block_gets_the_longest_row_that_fits(eos, density, mean):
    vocab = Vocabulary(size=VOCAB.size, tokenizer_size=V, special=VOCAB.special, eos_id=eos, decoder_start_id=START)
    sc = objective(vocab, noise_density=density, mean_span_length=mean)
    extra = 0 if eos is None else 1

    def fits(n, block):
        noise, spans = span_counts(n, density, mean)
        return max(n - noise + spans + extra, noise + spans + extra) <= block

    for block in range(3, 400):
        longest = max((n for n in range(2, block + 2) if fits(n, block)), default=None)
        if longest is None or span_counts(longest, density, mean)[1] > 100:
            with pytest.raises(UserError) as e:
                sc.layout(block + 1)
            assert e.value.key == ("model.block_size" if longest is None else "objective.noise_density")
            continue
        layout = sc.layout(block + 1)
        assert max(layout.encoder_length, layout.decoder_length) <= block
        assert not any(fits(n, block) for n in range(layout.n + 1, block + 2))
        if block in (4, 37, 128, 399):
            batch = sc.make_batch_from(Windows(random_tokens(rows=3, length=block + 1), seed=block))
            assert batch.encoder_ids.shape == (3, layout.encoder_length)
            assert batch.input_ids.shape == batch.targets.shape == (3, layout.decoder_length)


def test_same_seed_same_batch_and_a_replica_gets_its_rows():
    tokens = random_tokens(rows=8)
    a, b = objective(), objective()
    first, again = a.make_batch_from(Windows(tokens, seed=7)), b.make_batch_from(Windows(tokens, seed=7))
    other = a.make_batch_from(Windows(tokens, seed=8))
    for name in ("input_ids", "targets", "encoder_ids"):
        assert torch.equal(getattr(first, name), getattr(again, name))
    assert not torch.equal(first.encoder_ids, other.encoder_ids)
    for replica in (0, 1):
        rows = slice(4 * replica, 4 * replica + 4)
        part = a.make_batch_from(Windows(tokens[rows], seed=7, first_row=4 * replica, total_rows=8))
        for name in ("input_ids", "targets", "encoder_ids"):
            assert torch.equal(getattr(part, name), getattr(first, name)[rows])


def test_loss_is_the_mean_cross_entropy_over_the_targets():
    sc = objective()
    batch = sc.make_batch_from(Windows(random_tokens(rows=4), seed=1))
    logits = torch.randn(*batch.targets.shape, VOCAB.size, generator=torch.Generator().manual_seed(5)) * 2
    by_hand = -logits.double().log_softmax(-1).gather(-1, batch.targets[..., None]).mean()
    assert sc.loss(logits, batch).item() == pytest.approx(by_hand.item(), rel=1e-6)
    assert sc.loss(logits.bfloat16(), batch).dtype == torch.float32


@pytest.mark.parametrize("options", [dict(noise_density=0), dict(noise_density=1), dict(noise_density=1.5),
                                     dict(mean_span_length=0.5)])
def test_out_of_range_options_are_refused(options):
    with pytest.raises(ValueError):
        SpanCorruption.Options(**options)


def check_context(block_size: int) -> CheckContext:
    shape = ModelShape(n_layers=1, d_model=8, n_heads=1, block_size=block_size, vocab_size=VOCAB.size)
    return CheckContext(shape=shape, plugins={}, manifest={})


def test_more_spans_than_sentinels_are_refused_naming_the_key():
    sc = objective()
    sc.check(check_context(2008))                                 # 2009 tokens: 301 noise, 100 spans
    for refuse in (lambda: sc.check(check_context(2009)),         # 2010 tokens: 302 noise, 101 spans
                   lambda: sc.make_batch_from(Windows(random_tokens(rows=1, length=2010)))):
        with pytest.raises(UserError) as e:
            refuse()
        assert e.value.key == "objective.noise_density" and "101 noise spans" in str(e.value)
    objective(mean_span_length=4).check(check_context(2009))       # longer spans: fewer of them


def test_a_model_without_a_decoder_start_is_refused():
    sc = objective(Vocabulary(size=VOCAB.size, tokenizer_size=V, special=VOCAB.special, eos_id=EOS))
    with pytest.raises(UserError) as e:
        sc.make_batch_from(Windows(random_tokens(rows=2)))
    assert e.value.key == "architecture.use" and '[architecture] use = "encoder-decoder"' in str(e.value)


def test_the_plugin_asks_for_an_encoder_decoder_model_and_100_sentinels():
    assert SpanCorruption.trains() == ("encoder-decoder",)
    assert SpanCorruption.special_tokens == tuple(f"sentinel_{i}" for i in range(100))
    assert SpanCorruption.wants_windows()


@pytest.mark.parametrize("objective_table, key, says", [
    ("noise_density = 1.5", "objective.noise_density", "less than 1"),
    ("noise_density = 0.15", "objective.noise_density", "101 noise spans"),   # with block_size 2009 below
])
def test_bad_options_are_refused_by_check_naming_the_key(tmp_path, monkeypatch, capsys, objective_table, key, says):
    monkeypatch.setenv("LMLAB_CACHE", str(tmp_path / "cache"))
    (tmp_path / "c.txt").write_text("Thank you for inviting me to your party last week.\n")
    path = tmp_path / "m.toml"
    path.write_text(f'name = "sc"\n\n[model]\nblock_size = 2009\n\n[architecture]\nuse = "encoder-decoder"\n\n'
                    f'[data]\nuse = "text-file"\npath = "c.txt"\n\n'
                    f'[tracker]\nuse = "none"\n\n[objective]\nuse = "span-corruption"\n{objective_table}\n')
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"lmlab: error: {key}: ") and says in err and err.count("\n") == 1
