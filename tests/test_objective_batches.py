"""How batches reach objectives that ask for more than windows: labels sampled with the windows, padded
documents, a random stream per batch, all pure functions of (seed, step) that data-parallel replicas
slice; and the plain path for everyone else."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lmlab.api import IGNORE_INDEX, Objective, TokenSplit, UserError, Windows
from lmlab.train.batches import FixedDocuments, FixedWindowBatches, FixedWindows, RandomDocuments, RandomWindows

LENGTHS = [5, 9, 3, 14, 7, 6, 11, 4, 8, 10, 2, 12]  # documents of a toy split


def toy_split():
    """tokens where document d holds ids 100·d + 0, 1, ...; mask 1 on each document's second half."""
    tokens, mask, starts = [], [], []
    for d, n in enumerate(LENGTHS):
        starts.append(len(tokens))
        tokens += [100 * d + i for i in range(n)]
        mask += [int(i >= n // 2) for i in range(n)]
    return np.array(tokens, np.uint16), np.array(mask, np.uint8), np.array(starts, np.int64)


def mask_labels(mask):
    return lambda positions: mask[positions]


def test_rich_windows_are_the_plain_windows_with_the_mask_at_the_same_positions():
    tokens, mask, _ = toy_split()
    plain = RandomWindows(tokens, 8, 4, seed=3)
    rich = RandomWindows(tokens, 8, 4, seed=3, rich=True, labels=mask_labels(mask))
    for index in range(5):
        w = rich.batch(index)
        assert torch.equal(w.tokens, plain.batch(index))
        # ids 100·d + i give back the position of every token: its mask must be the one sampled
        expected = [[mask[position_of(t)] for t in row] for row in w.tokens.tolist()]
        assert w.labels.tolist() == expected and w.labels.dtype == torch.uint8


def position_of(token: int) -> int:
    d, i = divmod(token, 100)
    return sum(LENGTHS[:d]) + i


def test_replicas_take_their_rows_of_the_global_batch_with_the_same_random_stream():
    tokens, mask, starts = toy_split()
    for make in (lambda **kw: RandomWindows(tokens, 6, kw.pop("batch_size"), 9, rich=True, labels=mask_labels(mask), **kw),
                 lambda **kw: RandomDocuments(tokens, starts, 6, kw.pop("batch_size"), 9, labels=mask_labels(mask), **kw)):
        whole = make(batch_size=4).batch(7)
        parts = [make(batch_size=2, replica=r, replicas=2).batch(7) for r in (0, 1)]
        assert torch.equal(torch.cat([p.tokens for p in parts]), whole.tokens)
        assert torch.equal(torch.cat([p.labels for p in parts]), whole.labels)
        assert torch.equal(torch.cat([p.rand(5) for p in parts]), whole.rand(5))
        assert torch.equal(torch.cat([p.randint(50, 3) for p in parts]), whole.randint(50, 3))


def test_the_random_stream_is_a_function_of_seed_and_step():
    tokens, mask, _ = toy_split()
    sampler = RandomWindows(tokens, 6, 3, seed=1, rich=True)
    again = RandomWindows(tokens, 6, 3, seed=1, rich=True, start=4)
    assert torch.equal(sampler.batch(4).rand(8), next(iter(again)).rand(8))
    assert not torch.equal(sampler.batch(4).rand(8), sampler.batch(5).rand(8))
    assert not torch.equal(sampler.batch(4).rand(8), RandomWindows(tokens, 6, 3, seed=2, rich=True).batch(4).rand(8))


def test_padded_documents_start_at_a_document_and_pad_beyond_its_end():
    tokens, mask, starts = toy_split()
    sampler = RandomDocuments(tokens, starts, 7, 4, seed=0, labels=mask_labels(mask), pad_id=0)  # rows of 8
    for index in range(6):
        w = sampler.batch(index)
        for row, labels, padding in zip(w.tokens.tolist(), w.labels.tolist(), w.padding.tolist()):
            d = row[0] // 100
            n = LENGTHS[d]
            assert row[:min(n, 8)] == [100 * d + i for i in range(min(n, 8))]  # truncated at block_size + 1
            assert padding == [i >= n for i in range(8)]
            assert all(t == 0 for t, p in zip(row, padding) if p)
            assert labels == [int(i >= n // 2 and i < n) for i in range(8)]  # no label on padding


def test_each_epoch_of_documents_sees_every_document_once_in_a_new_order():
    tokens, _, starts = toy_split()
    sampler = RandomDocuments(tokens, starts, 7, 4, seed=0)  # 12 documents: 3 batches per epoch
    epochs = [np.concatenate([sampler.documents(i) for i in range(3 * e, 3 * e + 3)]) for e in range(3)]
    for order in epochs:
        assert sorted(order) == list(range(12))
    assert not np.array_equal(epochs[0], epochs[1])
    odd = RandomDocuments(tokens, starts, 7, 5, seed=0)  # batches that straddle epochs
    seen = np.concatenate([odd.documents(i) for i in range(12)])  # 60 samples = 5 epochs
    assert all(sorted(seen[12 * e:12 * e + 12]) == list(range(12)) for e in range(5))


def test_validation_documents_are_each_taken_once_with_fixed_draws():
    tokens, mask, starts = toy_split()
    val = FixedDocuments(tokens, starts, 7, 5, seed=0, labels=mask_labels(mask))
    assert len(val) == 3
    firsts = [row[0] // 100 for i in range(len(val)) for row in val[i].tokens.tolist()]
    assert firsts == list(range(12))
    assert torch.equal(val[1].rand(4), val[1].rand(4)) and not torch.equal(val[1].rand(4), val[2].rand(4))
    assert len(FixedDocuments(tokens, starts, 7, 5, seed=0, limit=4)) == 1


def test_validation_window_batches_hold_the_fixed_windows():
    tokens, mask, _ = toy_split()
    rows = FixedWindows(tokens, 6, limit=10)
    batches = FixedWindowBatches(tokens, 6, 4, seed=0, limit=10, labels=mask_labels(mask))
    assert len(batches) == 3
    stacked = torch.cat([batches[i].tokens for i in range(3)])
    assert torch.equal(stacked, torch.stack([rows[i] for i in range(len(rows))]))


class _Data:
    """The TokenData a data module reads, over the toy split (both splits alike)."""

    def __init__(self, masked=True):
        tokens, mask, starts = toy_split()
        self.train = self.val = tokens
        self.train_mask = self.val_mask = mask if masked else None
        self.starts = starts
        self.tokenizer = None

    def document_starts(self, split):
        return self.starts

    def split(self, name):
        return TokenSplit(name, self.train, self.train_mask, self.starts, None)


def datamodule(objective, data=None):
    from lmlab.train.data_module import TokenDataModule

    dm = TokenDataModule(data or _Data(), 6, 4, 4, 2, seed=0, grad_accum=1, objective=objective)
    dm.trainer = SimpleNamespace(global_step=0, strategy=SimpleNamespace())
    return dm


def sft(**options):
    from lmlab_objectives.sft import SFT

    return SFT(SFT.Options(**options))


def test_an_objective_that_asks_for_nothing_gets_the_plain_tensors():
    dm = datamodule(Objective())
    assert not dm.rich
    assert isinstance(next(iter(dm.train_dataloader())), torch.Tensor)
    assert isinstance(next(iter(dm.val_dataloader())), torch.Tensor)


@pytest.mark.parametrize("packing", [True, False])
def test_sft_gets_windows_or_padded_documents_with_the_loss_mask(packing):
    objective = sft(packing=packing)
    dm = datamodule(objective)
    for loader in (dm.train_dataloader(), dm.val_dataloader()):
        w = next(iter(loader))
        assert isinstance(w, Windows) and w.labels is not None and (w.padding is None) == packing
        batch = objective.make_batch_from(w)
        scored = batch.targets != IGNORE_INDEX
        # every scored target is a token of its document's second half (the "response")
        for t in batch.targets[scored].tolist():
            d, i = divmod(t, 100)
            assert i >= LENGTHS[d] // 2


def test_sft_on_a_corpus_without_masks_is_refused_naming_the_objective():
    with pytest.raises(UserError) as info:
        datamodule(sft(), _Data(masked=False))
    assert info.value.key == "objective.use"
