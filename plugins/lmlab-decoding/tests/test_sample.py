import pytest
import torch

from lmlab_decoding.greedy import GreedyDecoder
from lmlab_decoding.sample import SampleOptions, SamplingDecoder, filter_logits


def sampler(**options):
    return SamplingDecoder(SamplingDecoder.Options(**options))


def seeded(seed=0):
    return torch.Generator().manual_seed(seed)


def test_top_k_of_one_equals_greedy(bigram, table):
    prompt = torch.tensor([[3], [9], [12]])
    greedy = GreedyDecoder().generate(bigram(table), prompt, 15)
    assert torch.equal(sampler(top_k=1, temperature=2.0).generate(bigram(table), prompt, 15, generator=seeded()), greedy)


def test_tiny_temperature_equals_greedy(bigram, table):
    prompt = torch.tensor([[3], [9], [12]])
    greedy = GreedyDecoder().generate(bigram(table), prompt, 15)
    assert torch.equal(sampler(temperature=1e-4).generate(bigram(table), prompt, 15, generator=seeded()), greedy)


def test_top_p_keeps_exactly_the_smallest_nucleus():
    probs = torch.tensor([[0.10, 0.50, 0.15, 0.25]])  # ranked: 1 (0.5), 3 (0.25), 2 (0.15), 0 (0.1)
    for top_p, kept in [(0.45, [1]), (0.7, [1, 3]), (0.8, [1, 3, 2]), (0.95, [0, 1, 2, 3]), (1.0, [0, 1, 2, 3])]:
        filtered = filter_logits(probs.log(), top_p=top_p).softmax(-1)[0]
        expected = torch.zeros(4)
        expected[kept] = probs[0, kept] / probs[0, kept].sum()
        assert torch.allclose(filtered, expected, atol=1e-6), top_p


def test_top_k_keeps_the_k_most_likely_tokens():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    assert torch.isfinite(filter_logits(logits, top_k=2)).tolist() == [[False, True, False, True]]


def test_same_seed_reproduces_the_sample_and_another_seed_differs(bigram, table):
    prompt = torch.zeros(8, 1, dtype=torch.long)
    decoder = sampler(temperature=1.5)
    a = decoder.generate(bigram(table), prompt, 20, generator=seeded(0))
    b = decoder.generate(bigram(table), prompt, 20, generator=seeded(0))
    c = decoder.generate(bigram(table), prompt, 20, generator=seeded(1))
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize("options", [dict(temperature=0.7), dict(temperature=1.3, top_k=3)])
def test_empirical_frequencies_match_the_tempered_softmax(bigram, options):
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5])
    table = logits.expand(5, 5).clone()
    n = 20_000
    out = sampler(**options).generate(bigram(table), torch.zeros(n, 1, dtype=torch.long), 1, generator=seeded())
    freq = torch.bincount(out[:, 1], minlength=5).float() / n
    expected = filter_logits(logits[None], options["temperature"], options.get("top_k")).softmax(-1)[0]
    assert torch.allclose(freq, expected, atol=0.015)  # ~4 standard errors at n = 20k
    if "top_k" in options:
        assert freq[[2, 3]].sum() == 0


def test_bad_options_are_refused():
    for bad in [dict(temperature=-0.5), dict(top_k=0), dict(top_p=-0.1), dict(top_p=1.5)]:
        with pytest.raises(ValueError):
            SamplingDecoder.Options(**bad)


def test_temperature_zero_and_top_p_zero_are_greedy_as_openai_means_them(bigram, table):
    prompt = torch.tensor([[3], [9], [12]])
    greedy = GreedyDecoder().generate(bigram(table), prompt, 15)
    for options in (dict(temperature=0.0), dict(temperature=1.5, top_p=0.0)):
        assert torch.equal(sampler(**options).generate(bigram(table), prompt, 15, generator=seeded()), greedy)


def test_each_row_of_a_step_is_chosen_with_its_own_options_and_generator():
    from lmlab.api import TokenRows

    logits = torch.log(torch.tensor([[0.1, 0.6, 0.3]])).repeat(5, 1)
    logits[3] = torch.log(torch.tensor([0.5, 0.2, 0.3]))  # row 3's most likely token is 0
    options = [SampleOptions(temperature=0.0), SampleOptions(), SampleOptions(top_p=0.5),
               SampleOptions(temperature=2.0, top_p=0.3), SampleOptions(top_k=2)]
    shared = seeded(0)
    decoder = SamplingDecoder()
    draws = torch.stack([decoder.choose(logits, TokenRows(options, [shared] * 5)) for _ in range(3000)])  # (N, 5)
    assert (draws[:, 0] == 1).all() and (draws[:, 3] == 0).all() and (draws[:, 2] == 1).all()
    assert torch.allclose(torch.bincount(draws[:, 1], minlength=3) / len(draws), torch.tensor([0.1, 0.6, 0.3]),
                          atol=0.03)
    assert torch.allclose(torch.bincount(draws[:, 4], minlength=3) / len(draws),
                          torch.tensor([0.0, 0.6667, 0.3333]), atol=0.03)  # top-k 2 renormalised
    # a row with a generator of its own draws the same whatever the rows beside it
    for seed in range(20):
        alone = decoder.choose(logits[1:2], TokenRows(options[1:2], [seeded(seed)])).item()
        beside = decoder.choose(logits, TokenRows(options, [shared, seeded(seed), shared, shared, shared]))
        assert beside[1].item() == alone
