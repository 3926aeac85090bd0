import itertools
import math

import pytest
import torch

from lmlab_decoding.beam import BeamDecoder
from lmlab_decoding.greedy import GreedyDecoder


def beam(**options):
    return BeamDecoder(BeamDecoder.Options(**options))


def test_width_one_equals_greedy_over_both_engines(bigram, table, models):
    prompt = torch.tensor([[3, 5], [7, 7], [0, 1]])
    model = bigram(table)  # no kv_layout: the core's row-at-a-time engine
    assert torch.equal(beam(width=1).generate(model, prompt, 10), GreedyDecoder().generate(model, prompt, 10))
    target, _ = models(init_std=0.3)  # the kit's reference model: the core's shared-cache engine
    prompt = torch.randint(0, 11, (3, 4), generator=torch.Generator().manual_seed(0))
    for eos_id in (None, 0):
        assert torch.equal(beam(width=1).generate(target, prompt, 12, eos_id=eos_id),
                           GreedyDecoder().generate(target, prompt, 12, eos_id=eos_id))


def enumerate_best(table: torch.Tensor, start: int, limit: int, lp: float, eos: int, stop: int):
    """Every continuation of ``start`` under a bigram table, ended at eos, at the stop token (kept) or
    at ``limit`` tokens, with its score sum(log p) / length ** lp; best first."""
    log_probs = table.double().log_softmax(-1)
    scored = []
    for n in range(1, limit + 1):
        for seq in itertools.product(range(table.shape[0]), repeat=n):
            ends = [j for j, t in enumerate(seq) if t in (eos, stop)]
            if (ends and ends[0] != n - 1) or (not ends and n < limit):
                continue  # ended earlier, or not ended yet
            prev, total = start, 0.0
            for t in seq:
                total, prev = total + float(log_probs[prev, t]), t
            scored.append((total / n ** lp, list(seq)))
    return sorted(scored, key=lambda h: -h[0])


@pytest.mark.parametrize("lp", [0.6, 0.0, -0.7, 1.5])
def test_a_wide_enough_beam_finds_the_exhaustive_optimum(bigram, history_engine, recorder, run_decode, lp):
    V, limit, eos, stop = 4, 4, 3, 2
    table = torch.randn(V, V, generator=torch.Generator().manual_seed(int(10 * lp) + 5)) * 1.5
    width = (V - 2) ** (limit - 1) * V  # every live prefix at every step: nothing is pruned
    decoder = beam(width=width, length_penalty=lp, early_stopping=False, n_best=5)
    prompts = [[0], [1, 0, 1], [2]]
    outputs = recorder([limit] * 3, eos_id=eos, stop=[stop])
    yields = run_decode(decoder, history_engine(bigram(table)), prompts, outputs)
    for i, prompt in enumerate(prompts):
        expected = enumerate_best(table, prompt[-1], limit, lp, eos, stop)[:5]
        offered = outputs.offers[i]
        assert [t for t, _ in offered] == [t[:-1] if t[-1] == eos else t for _, t in expected]
        assert [s for _, s in offered] == pytest.approx([s for s, _ in expected], abs=1e-9)
        assert [y[i] for y in yields if i in y] == [expected[0][1]]  # yielded once, whole, EOS included


def test_n_best_are_ranked_and_the_best_is_yielded(history_engine, recorder, run_decode, models):
    target, _ = models(init_std=0.3)
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9, 10]]  # different lengths in one batch
    outputs = recorder([6, 9, 4], eos_id=0)
    yields = run_decode(beam(width=4, n_best=3), history_engine(target), prompts, outputs)
    log_probs = lambda seq: target(torch.tensor([seq]))[0].double().log_softmax(-1)  # noqa: E731
    for i, prompt in enumerate(prompts):
        offered = outputs.offers[i]
        assert len(offered) == 3 and len({tuple(t) for t, _ in offered}) == 3
        scores = [s for _, s in offered]
        assert scores == sorted(scores, reverse=True)
        best = [tokens for y in yields for j, tokens in y.items() if j == i]
        assert len(best) == 1 and best[0][:len(offered[0][0])] == offered[0][0]
        for tokens, score in offered:  # each score is its sequence's, recomputed
            seq = tokens + ([0] if len(tokens) < outputs.limits[i] else [])
            with torch.no_grad():
                lp = log_probs(prompt + seq)
            total = sum(float(lp[len(prompt) - 1 + j, t]) for j, t in enumerate(seq))
            assert score == pytest.approx(total / len(seq) ** 0.6, abs=1e-4)


def test_one_forward_pass_per_step_for_every_live_beam(history_engine, recorder, run_decode, models):
    target, _ = models(init_std=0.3)
    engine = history_engine(target)
    run_decode(beam(width=3), engine, [[1, 2], [3], [4, 5, 6]], recorder([5, 5, 5]))
    # No EOS, no stop: every prompt runs to its limit; one step of 3 prompts × 3 beams per new token
    # but the last (the limit ends every candidate there).
    assert engine.steps == [(9, 1)] * 4


def test_the_core_engine_reselects_rows_as_the_reference_engine_does(history_engine, recorder, run_decode, models):
    target, _ = models(init_std=0.3)
    prompt = torch.randint(0, 11, (4, 3), generator=torch.Generator().manual_seed(3))
    for eos_id in (None, 0):
        decoder = beam(width=3, length_penalty=1.0)
        outputs = recorder([10] * 4, eos_id=eos_id)
        run_decode(decoder, history_engine(target), prompt.tolist(), outputs)
        out = decoder.generate(target, prompt, 10, eos_id=eos_id)
        for r in range(4):
            new = out[r, 3:].tolist()
            if eos_id is not None and eos_id in new:
                new = new[:new.index(eos_id)]
            assert new == outputs.tokens[r]


def test_candidates_past_the_first_two_widths_are_read_when_those_all_end(bigram, history_engine, recorder,
                                                                          run_decode):
    # Tokens 0-3 are the likeliest and each ends the prompt (as stop strings may); only 4 goes on,
    # and it is the least likely: the search must read past the first 2 × width candidates to find it.
    # A strong length penalty makes the longest hypotheses the best ones.
    table = torch.tensor([[2.0, 1.9, 1.8, 1.7, 0.0]] * 5)
    outputs = recorder([3])
    outputs.ends = lambda i, tokens: len(tokens) >= 3 or tokens[-1] != 4  # noqa: E731
    run_decode(beam(width=2, n_best=2, length_penalty=2.0, early_stopping=False), history_engine(bigram(table)),
               [[4]], outputs)
    lp = table.double().log_softmax(-1)[0]
    assert outputs.offers[0] == [([4, 4, 0], pytest.approx(float(2 * lp[4] + lp[0]) / 9)),
                                 ([4, 4, 1], pytest.approx(float(2 * lp[4] + lp[1]) / 9))]


def test_early_stopping_finishes_sooner_and_never_better(history_engine, recorder, run_decode, models):
    target, _ = models(init_std=0.3)
    prompts = [[1, 2, 3], [4, 5], [6]]
    results = {}
    for early in (True, False):
        engine, outputs = history_engine(target), recorder([12] * 3, eos_id=0)
        run_decode(beam(width=3, length_penalty=1.0, early_stopping=early), engine, prompts, outputs)
        results[early] = (len(engine.steps), outputs.offers)
    assert results[True][0] <= results[False][0]
    for i in range(3):  # the exact stop keeps searching: its best is at least as good
        assert results[False][1][i][0][1] >= results[True][1][i][0][1] - 1e-12


class _HFWrapper(torch.nn.Module):
    def __init__(self, model, vocab_size):
        super().__init__()
        self.model, self.vocab_size = model, vocab_size

    def forward(self, idx, cache=None):
        return self.model(input_ids=idx).logits


@pytest.fixture(scope="module")
def tiny_gpt2():
    transformers = pytest.importorskip("transformers")
    transformers.utils.logging.set_verbosity_error()
    V, eos = 12, 11
    config = transformers.GPT2Config(vocab_size=V, n_positions=64, n_embd=16, n_layer=1, n_head=2,
                                     initializer_range=0.3, eos_token_id=eos, pad_token_id=eos, bos_token_id=eos)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(config).eval()


@pytest.mark.parametrize("early_stopping", [True, False])
def test_matches_hugging_face_beam_search(history_engine, recorder, run_decode, tiny_gpt2, early_stopping):
    settings = [(0.6, 2, 2), (1.0, 3, 3), (-0.5, 3, 2), (0.0, 4, 1), (2.0, 5, 3)]
    check_against_hugging_face(history_engine, recorder, run_decode, tiny_gpt2, early_stopping,
                               [(lp, width, n_best, {}) for lp, width, n_best in settings])


def test_penalised_beams_match_hugging_face_beam_search(history_engine, recorder, run_decode, tiny_gpt2):
    """The penalties act on each beam's log-probabilities with its prompt and tokens as history, as
    transformers' logits processors do inside its beam search; without them the search repeats."""
    settings = [(1.0, 3, 2, dict(repetition_penalty=1.5)), (0.6, 4, 2, dict(no_repeat_ngram_size=2)),
                (1.0, 2, 2, dict(repetition_penalty=0.7, no_repeat_ngram_size=3))]
    check_against_hugging_face(history_engine, recorder, run_decode, tiny_gpt2, False, settings)
    model = _HFWrapper(tiny_gpt2, 12)
    plain, banned = recorder([12]), recorder([12])  # no end-of-text: twelve tokens each
    run_decode(beam(width=3), history_engine(model), [[7, 7]], plain)
    run_decode(beam(width=3, no_repeat_ngram_size=2), history_engine(model), [[7, 7]], banned)
    looped, clean = _bigrams([7, 7] + plain.tokens[0]), _bigrams([7, 7] + banned.tokens[0])
    assert len(set(looped)) < len(looped)  # the plain search repeats a bigram
    assert len(banned.tokens[0]) == 12 and len(set(clean)) == len(clean)


def _bigrams(text: list[int]) -> list[tuple[int, int]]:
    return [tuple(text[i:i + 2]) for i in range(len(text) - 1)]


def check_against_hugging_face(history_engine, recorder, run_decode, hf, early_stopping, settings):
    V, eos, n = 12, 11, 7
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8], [9, 9], [0, 3, 10]]
    for lp, width, n_best, penalties in settings:
        decoder = beam(width=width, n_best=n_best, length_penalty=lp, early_stopping=early_stopping, **penalties)
        outputs = recorder([n] * len(prompts), eos_id=eos)
        run_decode(decoder, history_engine(_HFWrapper(hf, V)), prompts, outputs)
        for i, prompt in enumerate(prompts):
            with torch.no_grad():
                ref = hf.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=n_best,
                                  length_penalty=lp, early_stopping=True if early_stopping else "never",
                                  max_new_tokens=n, do_sample=False, output_scores=True,
                                  return_dict_in_generate=True, eos_token_id=eos, pad_token_id=eos, **penalties)
            expected = [s[:s.index(eos)] if eos in s else s for s in ref.sequences[:, len(prompt):].tolist()]
            offered = outputs.offers[i]
            assert [t for t, _ in offered] == expected, (lp, width, penalties, i)
            assert [s for _, s in offered] == pytest.approx(ref.sequences_scores.tolist(), abs=1e-4)
            assert outputs.tokens[i] == expected[0]


def test_rows_per_prompt_is_the_width():
    assert beam(width=5).rows_per_prompt() == 5


def test_bad_options_are_refused():
    for bad in [dict(width=0), dict(n_best=0), dict(width=2, n_best=3), dict(early_stopping=1),
                dict(length_penalty=math.inf)]:
        with pytest.raises(ValueError):
            BeamDecoder.Options(**bad)
