"""Gradient accumulation is the larger batch: batch_size b with grad_accum k draws the same windows in
the same order as batch_size k·b, step for step (on any number of data-parallel replicas), so the two
train the same model; and each variant of a sweep run in one process reports its own peak memory."""

import json
import os

import numpy as np
import pytest
import torch

from lmlab.train.batches import RandomDocuments, RandomWindows
from lmlab.train.replay import Replayed
from support import run_cli

TOKENS = np.arange(5_000, dtype=np.uint16) % 251


def micro_batches(make, accum: int, replicas: int, step: int) -> list:
    """Every (micro-batch, replica) batch of optimizer step ``step``, in global row order."""
    return [make(replica=r, replicas=replicas, accum=accum).batch(step * accum + j)
            for j in range(accum) for r in range(replicas)]


@pytest.mark.parametrize("accum, replicas", [(2, 1), (4, 1), (2, 2)])
def test_accumulated_micro_batches_hold_the_rows_of_the_larger_batch(accum, replicas):
    b = 8 // (accum * replicas)
    whole = RandomWindows(TOKENS, 16, 8, seed=3)
    for step in (0, 1, 7):
        parts = micro_batches(lambda **kw: RandomWindows(TOKENS, 16, b, seed=3, **kw), accum, replicas, step)
        assert torch.equal(torch.cat(parts), whole.batch(step))


def test_an_objectives_random_draws_are_those_of_the_larger_batch():
    whole = RandomWindows(TOKENS, 16, 8, seed=3, rich=True).batch(5)
    parts = micro_batches(lambda **kw: RandomWindows(TOKENS, 16, 2, seed=3, rich=True, **kw), 2, 2, 5)
    assert torch.equal(torch.cat([p.tokens for p in parts]), whole.tokens)
    assert torch.equal(torch.cat([p.rand(16) for p in parts]), whole.rand(16))  # e.g. mlm's masking


def test_documents_and_replayed_rows_follow_the_larger_batch_too():
    starts = np.arange(0, 5_000, 97)
    whole = RandomDocuments(TOKENS, starts, 15, 8, seed=1).batch(3)
    parts = micro_batches(lambda **kw: RandomDocuments(TOKENS, starts, 15, 4, seed=1, **kw), 2, 1, 3)
    assert torch.equal(torch.cat([p.tokens for p in parts]), whole.tokens)

    corpus = (np.arange(3_000, dtype=np.uint16) * 7) % 251
    def half(step):
        return 0.5

    full = Replayed(RandomWindows(TOKENS, 16, 8, seed=2), corpus, half, 16, 8, seed=2).batch(4)
    halves = micro_batches(lambda **kw: Replayed(RandomWindows(TOKENS, 16, 4, seed=2, **kw), corpus, half, 16, 4,
                                                 seed=2, **kw), 2, 1, 4)
    assert torch.equal(torch.cat(halves), full)


def test_batch_8_equals_4_accumulated_twice_and_2_accumulated_four_times(tiny_manifest, tmp_path):
    path = tiny_manifest(steps=12, eval_every=6, checkpoint_every=12)
    losses = {}
    for batch, accum in ((8, 1), (4, 2), (2, 4)):
        out = tmp_path / f"b{batch}"
        result = run_cli("run", str(path), "--out", str(out), "--set", f"train.batch_size={batch}",
                         "--set", f"train.grad_accum={accum}", "--set", "train.eval_batch_size=16",
                         "--set", "train.sample_tokens=0")
        assert result.returncode == 0, result.stderr[-2000:]
        records = [json.loads(line) for line in (out / "default" / "metrics.jsonl").read_text().splitlines()]
        losses[batch] = ([r["train_loss"] for r in records if "train_loss" in r],
                         [r["val_loss"] for r in records if "val_loss" in r])
    # The same rows each step; only the order of float32 sums differs. Before, the micro-batches drew
    # other windows and final val losses differed by 3e-3 to 8e-3.
    for batch in (4, 2):
        np.testing.assert_allclose(losses[batch][0], losses[8][0], atol=2e-5)  # the step's loss, not a micro-batch's
        np.testing.assert_allclose(losses[batch][1], losses[8][1], atol=2e-5)


def test_each_variant_of_a_sweep_in_one_process_reports_its_own_peak_memory(tiny_manifest, tmp_path):
    # The big variant first: a peak that covered the whole process would carry it over to the small one.
    path = tiny_manifest('\n[sweep]\n"model.d_model" = [384, 32]\n', steps=3, eval_every=3, checkpoint_every=3)
    # glibc returns freed blocks at once, so the resident set follows live tensors.
    result = run_cli("run", str(path), "--out", str(tmp_path / "out"), "--set", "train.batch_size=64",
                     "--set", "model.block_size=128", "--set", "train.sample_tokens=0",
                     env={"MALLOC_MMAP_THRESHOLD_": "131072"})
    assert result.returncode == 0, result.stderr[-2000:]
    big, small = (json.loads((tmp_path / "out" / f"model.d_model={d}" / "summary.json").read_text())["peak_mem_mb"]
                  for d in (384, 32))
    assert big - small > 100, (big, small)
    assert small > 0 and os.path.exists(tmp_path / "out" / "sweep.json")
    # lmlab compare's legend says what was just measured: each variant's own peak, not the process's.
    compared = run_cli("compare", str(tmp_path / "out"))
    assert compared.returncode == 0, compared.stderr[-2000:]
    (legend,) = [line for line in compared.stdout.splitlines() if "peak MB:" in line]
    assert "the variant's own peak" in legend and "cumulative over the variants" not in legend
