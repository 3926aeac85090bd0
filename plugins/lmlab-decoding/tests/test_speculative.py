import itertools

import pytest
import torch

from lmlab_decoding.greedy import GreedyDecoder
from lmlab_decoding.sample import filter_logits
from lmlab_decoding.speculative import SpeculativeDecoder


def speculative(draft_model, target=None, **options):
    decoder = SpeculativeDecoder(SpeculativeDecoder.Options(draft="draft-run", **options))
    if draft_model is not None:
        decoder.prepare(target, {"draft": draft_model})
    return decoder


@pytest.mark.parametrize("init_std", [0.03, 0.3])  # a draft that agrees often, one that seldom does
@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_output_is_the_targets_token_for_token(models, init_std, k):
    target, draft = models(init_std=init_std)  # the draft: a smaller model (one block of three)
    prompt = torch.randint(0, 11, (5, 4), generator=torch.Generator().manual_seed(k))
    proposed = accepted = 0
    for n in (1, 2, 3, 17):
        for eos_id in (None, 0):
            decoder = speculative(draft, target, k=k)
            out = decoder.generate(target, prompt, n, eos_id=eos_id)
            assert torch.equal(out, GreedyDecoder().generate(target, prompt, n, eos_id=eos_id)), (n, eos_id)
            proposed, accepted = proposed + decoder.stats["proposed"], accepted + decoder.stats["accepted"]
    assert 0 < accepted < proposed  # both verdicts were exercised


def test_rows_of_different_lengths_and_limits_are_never_fed_past_them(models, history_engine, recorder, run_decode):
    target, draft = models(init_std=0.3)
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9, 10], [2, 2]]
    limits = [5, 9, 12, 1]
    greedy = recorder(limits)
    run_decode(GreedyDecoder(), history_engine(target), prompts, greedy)
    for k in (2, 4):
        engine, outputs = history_engine(target), recorder(limits)
        yields = run_decode(speculative(draft, target, k=k), engine, prompts, outputs)
        assert outputs.tokens == greedy.tokens
        for i, (prompt, limit) in enumerate(zip(prompts, limits)):
            # The target never holds more than the prompt and all new tokens but the last.
            assert engine.longest[i] == len(prompt) + limit - 1
            assert sum(len(y.get(i, [])) for y in yields) == limit  # never more than the limit is yielded
        assert max(tokens for _, tokens in engine.steps) == k + 1  # the pending token and k drafts


def test_acceptance_rate_is_one_when_the_draft_is_the_target(models):
    target, _ = models(init_std=0.3)
    decoder = speculative(target, target, k=4)
    prompt = torch.randint(0, 11, (3, 4), generator=torch.Generator().manual_seed(0))
    out = decoder.generate(target, prompt, 20)
    assert torch.equal(out, GreedyDecoder().generate(target, prompt, 20))
    assert decoder.stats["proposed"] > 0 and decoder.acceptance_rate == 1.0
    # Each round makes k + 1 tokens: after the first token, 19 more take 4 rounds of 5 (the last of 4).
    assert decoder.stats["proposed"] == 3 * (4 * 3 + 3)
    decoder.generate(target, prompt, 20)  # the counts add up over calls (bench/decoding.py resets them)
    assert decoder.stats == {"proposed": 2 * 3 * (4 * 3 + 3), "accepted": 2 * 3 * (4 * 3 + 3)}


def test_without_a_draft_it_decodes_the_target_alone(models):
    target, _ = models(init_std=0.3)
    prompt = torch.randint(0, 11, (3, 4), generator=torch.Generator().manual_seed(0))
    decoder = speculative(None)
    assert torch.equal(decoder.generate(target, prompt, 9), GreedyDecoder().generate(target, prompt, 9))
    assert decoder.stats == {"proposed": 0, "accepted": 0} and decoder.acceptance_rate is None


def exact_joint(model, prompt, n, options):
    """The target's probability of every sequence of its first n new tokens, sampled under options."""
    V = model.vocab_size
    cells = list(itertools.product(range(V), repeat=n))
    seqs = torch.tensor([prompt + list(c[:-1]) for c in cells])
    with torch.no_grad():
        logits = model(seqs)[:, len(prompt) - 1:].float()  # (cells, n, V)
    probs = filter_logits(logits.reshape(-1, V), options.get("temperature", 1.0), options.get("top_k"),
                          options.get("top_p")).softmax(-1).view(len(cells), n, V)
    return cells, probs.gather(2, torch.tensor(cells)[:, :, None])[:, :, 0].prod(dim=1).double()


@pytest.mark.parametrize("options", [dict(temperature=1.0), dict(temperature=0.7, top_k=3, top_p=0.9)])
def test_sampling_follows_the_targets_distribution(models, options):
    from scipy.stats import chisquare

    V, prompt, n, draws = 4, [0, 1, 2], 3, 12_000
    target, draft = models(V=V, d_model=16, init_std=0.3)
    cells, expected = exact_joint(target, prompt, n, options)
    _, drafts = exact_joint(draft, prompt, n, options)
    assert 0.5 * (expected - drafts).abs().sum() > 0.2  # the draft alone would be far off: the test can tell
    decoder = speculative(draft, target, k=4, **options)
    out = decoder.generate(target, torch.tensor([prompt] * draws), 6, generator=torch.Generator().manual_seed(0))
    assert 0.2 < decoder.acceptance_rate < 0.9
    index = {c: j for j, c in enumerate(cells)}
    observed = torch.bincount(torch.tensor([index[tuple(r)] for r in out[:, 3:3 + n].tolist()]),
                              minlength=len(cells)).double()
    assert observed[expected == 0].sum() == 0  # nothing outside top-k / the nucleus
    counts = expected * draws
    big = counts >= 5  # cells expected fewer than 5 times are pooled into one
    f_obs = torch.cat([observed[big], observed[~big].sum()[None]])
    f_exp = torch.cat([counts[big], counts[~big].sum()[None]])
    keep = f_exp > 0
    f_obs, f_exp = f_obs[keep], f_exp[keep]
    f_exp = f_exp * f_obs.sum() / f_exp.sum()  # the exact probabilities sum to 1 up to float32 rounding
    assert chisquare(f_obs.numpy(), f_exp.numpy()).pvalue > 1e-3


def test_same_seed_same_sample(models):
    target, draft = models(init_std=0.3)
    prompt = torch.randint(0, 11, (4, 3), generator=torch.Generator().manual_seed(0))
    decoder = speculative(draft, target, temperature=1.0)
    a, b, c = (decoder.generate(target, prompt, 12, generator=torch.Generator().manual_seed(s)) for s in (0, 0, 1))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_bad_options_are_refused():
    for bad in [dict(draft="run", k=0), dict(draft="run", temperature=-1.0), dict(draft="run", top_k=0),
                dict(draft="run", top_p=0.0), dict(draft="run", top_p=1.5), dict(), dict(draft="")]:
        with pytest.raises(ValueError):
            SpeculativeDecoder.Options(**bad)


def test_it_asks_for_its_draft_run():
    assert SpeculativeDecoder.needs_runs == ("draft",)
