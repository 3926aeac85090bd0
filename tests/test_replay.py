"""[order] use = "replay": a share of fine-tuning rows drawn from the [init] run's own training corpus."""

import json

import numpy as np
import pytest
import torch

from lmlab import manifest
from lmlab.api import Windows
from lmlab.cli.main import main
from lmlab.train import runner
from lmlab.train.batches import RandomDocuments, RandomWindows
from lmlab.train.replay import Replayed

from conftest import CORPUS, tiny_toml

MAIN = np.arange(100_000, 110_000, dtype=np.int64)  # token values tell the corpora apart
REPLAY = np.arange(0, 50_000, dtype=np.int64)


def replayed(fraction, replica=0, replicas=1, rich=False, batch_size=8):
    inner = RandomWindows(MAIN, 16, batch_size, seed=5, replica=replica, replicas=replicas, rich=rich,
                          labels=(lambda positions: np.zeros(positions.shape, np.uint8)) if rich else None)
    return Replayed(inner, REPLAY, lambda step: fraction, 16, batch_size, seed=5, replica=replica, replicas=replicas)


def is_replay_row(row: torch.Tensor) -> bool:
    return bool((row < 100_000).all())


def test_the_share_of_replayed_rows_matches_the_option_and_each_is_a_window_of_the_corpus():
    data = replayed(0.2)
    rows = [row for i in range(400) for row in data.batch(i)]  # 3200 rows
    replays = [row for row in rows if is_replay_row(row)]
    share = len(replays) / len(rows)
    assert abs(share - 0.2) < 4 * (0.2 * 0.8 / len(rows)) ** 0.5  # within 4 sigma
    for row in replays[:50]:  # consecutive tokens of the replay corpus
        assert torch.equal(row, torch.arange(row[0].item(), row[0].item() + 17))
    for row in rows:  # no row mixes the two corpora
        assert is_replay_row(row) or bool((row >= 100_000).all())


def test_the_rows_are_those_drawn_when_replay_was_a_data_option():
    # Recorded from lmlab before API 1.19 ([data] replay = 0.3): a run moved to [order] use = "replay"
    # trains on the same rows.
    data = replayed(0.3)
    assert [data.batch(i)[:, 0].tolist() for i in range(3)] == [
        [23000, 26314, 100226, 108065, 104680, 523, 106291, 102853],
        [108884, 23290, 105703, 103903, 29806, 40642, 107344, 104099],
        [47769, 104514, 11670, 103517, 104187, 102117, 104210, 100139]]


def test_the_share_is_asked_of_the_order_at_each_step():
    inner = RandomWindows(MAIN, 16, 8, seed=5)
    schedule = Replayed(inner, REPLAY, lambda step: 0.0 if step % 2 else 0.9, 16, 8, seed=5)
    assert all(not is_replay_row(row) for row in schedule.batch(1))
    assert sum(is_replay_row(row) for i in range(0, 40, 2) for row in schedule.batch(i)) > 100


def test_replayed_rows_are_the_same_again_and_replicas_take_their_slice_of_the_global_batch():
    whole = replayed(0.3, batch_size=8)
    for i in range(20):
        assert torch.equal(whole.batch(i), replayed(0.3, batch_size=8).batch(i))  # a pure function of (seed, step)
        halves = [replayed(0.3, replica=r, replicas=2, batch_size=4).batch(i) for r in (0, 1)]
        assert torch.equal(torch.cat(halves), whole.batch(i))


def test_in_windows_a_replayed_row_is_scored_everywhere_and_never_padded():
    docs = np.arange(0, 10_000, 50)
    inner = RandomDocuments(MAIN, docs, 16, 8, seed=5, labels=lambda p: np.zeros(p.shape, np.uint8))
    data = Replayed(inner, REPLAY, lambda step: 0.5, 16, 8, seed=5)
    seen = 0
    for i in range(20):
        batch = data.batch(i)
        assert isinstance(batch, Windows)
        for row, labels, padding in zip(batch.tokens, batch.labels, batch.padding):
            if is_replay_row(row):
                seen += 1
                assert labels.all() and not padding.any()
            else:
                assert not labels.any()
    assert seen > 20


def test_no_replay_leaves_the_batches_untouched():
    assert torch.equal(replayed(0.0).batch(3), RandomWindows(MAIN, 16, 8, seed=5).batch(3))


BASE = tiny_toml("tiny.txt", name="base", steps=2, warmup_steps=1, eval_every=2, checkpoint_every=2,
                 sample_tokens=0)

SFT = """
name = "sft"
[init]
from = "{init}"
[data]
use = "alpaca"
path = "{data}"
template = "compact"
response_end = "\\n"
[order]
use = "replay"
share = 0.5
[objective]
use = "sft"
packing = false
[train]
max_steps = 4
batch_size = 4
warmup_steps = 1
eval_every = 4
eval_steps = 2
checkpoint_every = 4
sample_tokens = 0
[tracker]
use = "none"
"""


def test_a_fine_tune_replays_its_init_runs_corpus_and_replay_needs_an_lmlab_init(tmp_path, capsys):
    (tmp_path / "tiny.txt").write_text(CORPUS.read_text()[:30_000])
    (tmp_path / "base.toml").write_text(BASE)
    (base,) = manifest.load(tmp_path / "base.toml")
    runner.run_variant(base, tmp_path / "runs" / "base")
    records = tmp_path / "tasks.jsonl"
    records.write_text("".join(json.dumps({"instruction": "Say it.", "input": w, "output": w}) + "\n"
                               for w in ("to be", "or not", "that is", "the question") * 10))
    path = tmp_path / "sft.toml"
    path.write_text(SFT.format(init=tmp_path / "runs" / "base", data=records.name))
    (variant,) = manifest.load(path)
    seen = []

    class Spy:
        from lmlab.api import hookimpl

        @hookimpl
        def lmlab_model_built(self, model, manifest):
            seen.append(True)

    result = runner.run_variant(variant, tmp_path / "runs" / "sft", extra_hooks=[Spy()])
    assert result.summary["status"] == "completed" and seen
    data = result.module.trainer.datamodule
    batches = Replayed(RandomDocuments(data.tokens.train, data.tokens.document_starts("train"), 16, 4, seed=1),
                       data.replay, data.order.replay_share, 16, 4, seed=1)
    replay_rows = sum(int(r) for i in range(10) for r in (batches.batch(i).padding.sum(dim=1) == 0))
    assert replay_rows > 0
    # The replayed corpus is the init run's training split, tokenised by the same tokenizer.
    assert len(data.replay) == json.loads((tmp_path / "runs" / "base" / "summary.json").read_text())["data"]["tokens"]["train"]

    # Refused before anything runs, naming the order: without an [init], with a Hugging Face [init]
    # (no prepared corpus to replay), with an objective that is not causal; and the older spelling.
    no_init = tmp_path / "no-init.toml"
    no_init.write_text(SFT.replace('[init]\nfrom = "{init}"\n', "").format(data=records.name))
    for args in (["check", str(no_init)], ["run", str(no_init), "--out", str(tmp_path / "x")]):
        capsys.readouterr()
        assert main(args) == 2
        err = capsys.readouterr().err
        assert "order.use" in err and "no [init] from" in err, err
    assert not (tmp_path / "x").exists()
    old = tmp_path / "old.toml"
    old.write_text(SFT.replace('[order]\nuse = "replay"\nshare = 0.5\n', "").replace(
        'response_end = "\\n"\n', 'response_end = "\\n"\nreplay = 0.5\n').format(init=tmp_path / "runs" / "base",
                                                                                 data=records.name))
    capsys.readouterr()
    assert main(["check", str(old)]) == 2
    err = capsys.readouterr().err
    assert "data.replay" in err and '[order] use = "replay" with share = 0.5' in err, err


def test_a_run_recorded_with_data_replay_reads_as_the_replay_order():
    from lmlab.upgrade import upgrade_recorded

    recorded = {"data": {"use": "alpaca", "replay": 0.05}, "order": {"use": "uniform", "start": 0.2}}
    assert upgrade_recorded(recorded)["order"] == {"use": "replay", "share": 0.05}
    assert upgrade_recorded(recorded)["data"] == {"use": "alpaca"}
    none = upgrade_recorded({"data": {"use": "text-file", "replay": 0.0}})
    assert none["data"] == {"use": "text-file"} and "order" not in none
    # API 1.17 and 1.18 allowed a curriculum beside replay: the curriculum is kept
    both = upgrade_recorded({"data": {"use": "jsonl", "replay": 0.1}, "order": {"use": "length"}})
    assert both["order"] == {"use": "length"}
