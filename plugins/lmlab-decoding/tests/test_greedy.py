import torch

from lmlab_decoding.greedy import GreedyDecoder


def test_greedy_takes_the_argmax_at_every_step(bigram, chain, table):
    model = bigram(table)
    prompt = torch.tensor([[3, 5], [7, 7], [0, 1]])
    out = GreedyDecoder().generate(model, prompt, max_new_tokens=10)
    assert out.shape == (3, 12) and torch.equal(out[:, :2], prompt)
    for row in range(3):
        assert out[row, 2:].tolist() == chain(table, int(prompt[row, -1]), 10)


def test_decoding_feeds_one_token_per_step_through_the_cache(bigram, table):
    model = bigram(table)
    GreedyDecoder().generate(model, torch.tensor([[1, 2, 3, 4]]), max_new_tokens=6)
    assert model.calls == [4] + [1] * 5  # the prompt once, then each new token (none after the last)


def test_prompt_longer_than_the_context_slides_the_window(bigram, chain, table):
    model = bigram(table, max_context=4)  # asserts that no call overflows the cache or the context
    prompt = torch.randint(0, 16, (2, 10), generator=torch.Generator().manual_seed(1))
    out = GreedyDecoder().generate(model, prompt, max_new_tokens=12)
    assert out.shape == (2, 22)
    for row in range(2):
        assert out[row, 10:].tolist() == chain(table, int(prompt[row, -1]), 12)
    assert max(model.calls) <= 4


def eos_table():
    # token 0 → 1, 1 → 4 (eos), 2 → 3, 3 → 2, 4 → 0: a row that reached eos would go on with 0.
    t = torch.full((5, 5), -5.0)
    for current, following in {0: 1, 1: 4, 2: 3, 3: 2, 4: 0}.items():
        t[current, following] = 5.0
    return t


def test_finished_rows_are_padded_with_eos_while_others_continue(bigram):
    out = GreedyDecoder().generate(bigram(eos_table()), torch.tensor([[0], [2]]), max_new_tokens=6, eos_id=4)
    assert out.tolist() == [[0, 1, 4, 4, 4, 4, 4], [2, 3, 2, 3, 2, 3, 2]]


def test_generation_stops_once_every_row_has_emitted_eos(bigram):
    model = bigram(eos_table())
    out = GreedyDecoder().generate(model, torch.tensor([[0], [1]]), max_new_tokens=6, eos_id=4)
    assert out.tolist() == [[0, 1, 4], [1, 4, 4]]
    # A model without kv_layout is fed one row at a time: two prompts, then one step of the only
    # row not finished (row 1 emitted eos at once and left the batch).
    assert model.calls == [1, 1, 1]


def test_zero_new_tokens_returns_the_prompt(bigram, table):
    prompt = torch.tensor([[1, 2]])
    assert torch.equal(GreedyDecoder().generate(bigram(table), prompt, max_new_tokens=0), prompt)
