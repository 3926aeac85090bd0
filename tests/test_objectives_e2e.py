"""The sft and mlm objectives end to end, from a manifest: prompt-masked fine-tuning on Alpaca records,
masked language modelling on text, and the refusals (a causal-only mixer, a corpus without masks,
generating from a bidirectional model)."""

import json
import math
import random
import tomllib
from pathlib import Path

import pytest
import torch

from lmlab import manifest
from lmlab.api import IGNORE_INDEX
from lmlab.cli.main import main
from lmlab.prepare import tokens as token_cache
from lmlab.train.batches import FixedDocuments, RandomWindows

ROOT = Path(__file__).resolve().parent.parent

SFT = """
name = "sft-tiny"
seed = 5

[data]
use = "alpaca"
path = "records.json"
template = "compact"

[model]
n_layers = 2
d_model = 32
n_heads = 4
block_size = 64

[objective]
use = "sft"
packing = {packing}

[train]
max_steps = 6
batch_size = 4
warmup_steps = 2
eval_every = 3
eval_steps = 2
checkpoint_every = 3
log_every = 2
sample_tokens = 0

[tracker]
use = "none"
"""


@pytest.fixture
def alpaca_manifest(tmp_path):
    rng = random.Random(0)
    records = []
    for i in range(120):
        word = "".join(rng.choice("abcdefgh") for _ in range(rng.randint(3, 9)))
        if i % 3:
            records.append({"instruction": "Reverse the word.", "input": word, "output": word[::-1]})
        else:
            records.append({"instruction": f"Say {word} twice.", "input": "", "output": f"{word} {word}"})
    (tmp_path / "records.json").write_text(json.dumps(records))

    def write(packing: bool) -> Path:
        path = tmp_path / f"sft-{packing}.toml"
        path.write_text(SFT.format(packing=str(packing).lower()))
        return path

    write.records = records
    return write


@pytest.mark.parametrize("packing", [False, True])
def test_sft_on_alpaca_records_trains_from_a_manifest(alpaca_manifest, tmp_path, packing):
    out = tmp_path / "runs"
    assert main(["run", str(alpaca_manifest(packing)), "--out", str(out)]) == 0
    summary = json.loads((out / "default" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 6
    assert 0 < summary["val_loss"] < 10 and summary["plugins"]["objective"]["name"] == "sft"


def test_padded_sft_batches_score_exactly_each_records_response(alpaca_manifest):
    (variant,) = manifest.load(alpaca_manifest(False))
    data = token_cache.load_tokens(variant)
    objective = variant.instantiate("objective")
    batches = FixedDocuments(data.val, data.document_starts("val"), 64, 8, seed=0,
                             labels=objective.token_labels(data.split("val")))
    responses = [r["output"] for r in alpaca_manifest.records]
    held_out = responses[9::10]  # every tenth record is a validation one
    seen = []
    for i in range(len(batches)):
        batch = objective.make_batch_from(batches[i])
        for row in range(batch.targets.shape[0]):
            scored = batch.targets[row][batch.targets[row] != IGNORE_INDEX]
            seen.append(data.tokenizer.decode(scored))
    assert seen == held_out


def test_packed_sft_batches_score_only_response_characters(alpaca_manifest):
    (variant,) = manifest.load(alpaca_manifest(True))
    data = token_cache.load_tokens(variant)
    objective = variant.instantiate("objective")
    windows = RandomWindows(data.train, 64, 8, seed=1, rich=True, labels=objective.token_labels(data.split("train")))
    prompt_only = set("IRnstuion:\n")  # letters of the template's words that no response here contains
    for index in range(3):
        batch = objective.make_batch_from(windows.batch(index))
        scored = data.tokenizer.decode(batch.targets[batch.targets != IGNORE_INDEX])
        assert scored and not set(scored) & prompt_only
        unscored = data.tokenizer.decode(batch.input_ids[:, 1:][batch.targets[:, :-1] == IGNORE_INDEX])
        assert set(unscored) & prompt_only


def test_sft_on_a_plain_text_corpus_is_refused_naming_the_objective(tiny_manifest, tmp_path, capsys):
    path = tiny_manifest('[objective]\nuse = "sft"\n', steps=2, eval_every=2)
    assert main(["run", str(path), "--out", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    assert "objective.use" in err and "alpaca" in err and "Traceback" not in err


MLM = """
[objective]
use = "mlm"
mask_rate = 0.3
span_mean = 2
span_max = 4

[optimizer]
use = "adamw"
lr = 3e-3
"""


def test_mlm_on_text_trains_bidirectionally_and_its_validation_loss_falls(tiny_manifest, tmp_path, capsys):
    out = tmp_path / "runs"
    path = tiny_manifest(MLM, steps=60, eval_every=10, checkpoint_every=60)
    assert main(["run", str(path), "--out", str(out)]) == 0
    assert "--- sample" not in capsys.readouterr().out  # a bidirectional model does not generate
    records = [json.loads(line) for line in (out / "default" / "metrics.jsonl").read_text().splitlines()]
    val = [r["val_loss"] for r in records if "val_loss" in r]
    assert val[-1] < val[0] - 0.2 and val[-1] < math.log(60) - 0.7, val  # below uniform guessing, too
    resolved = tomllib.loads((out / "default" / "manifest.toml").read_text())
    checkpoint = torch.load(out / "default" / "checkpoints" / "last.ckpt", weights_only=True)
    embedding = checkpoint["state_dict"]["model.tok_emb.weight"]
    assert embedding.shape[0] == resolved["model"]["vocab_size"]  # the char vocabulary plus [MASK]

    assert main(["generate", str(out / "default"), "--prompt", "ROMEO:"]) == 2
    err = capsys.readouterr().err
    assert "objective.use" in err and "bidirectional" in err


def test_mlm_with_a_causal_only_mixer_exits_2_naming_attention_use(tiny_manifest, tmp_path, capsys):
    path = tiny_manifest(MLM + '[attention]\nuse = "mamba"\n[position]\nuse = "none"\n', steps=2, eval_every=2)
    assert main(["run", str(path), "--out", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    assert "attention.use" in err and "mamba" in err and "Traceback" not in err


def test_the_mlm_experiment_is_a_valid_manifest(capsys):
    assert main(["check", str(ROOT / "experiments" / "mlm.toml")]) == 0
    out = capsys.readouterr().out
    assert 'use = "mlm"' in out and "code_mask_rate = 0.5" in out


def test_an_mlm_run_resumed_from_a_checkpoint_draws_the_same_masks_as_an_uninterrupted_one(tiny_manifest, tmp_path):
    from lmlab.train.runner import run_variant

    path = tiny_manifest(MLM, steps=12, eval_every=6, checkpoint_every=6)
    fixed = ["train.decay_steps=12", "train.sample_tokens=0"]  # the schedule must not depend on max_steps
    (whole,) = manifest.load(path, fixed)
    (first,) = manifest.load(path, [*fixed, "train.max_steps=6"])
    reference = run_variant(whole, tmp_path / "whole").summary
    run_variant(first, tmp_path / "resumed")
    resumed = run_variant(whole, tmp_path / "resumed", resume=True).summary
    assert resumed["steps"] == reference["steps"] == 12
    assert resumed["val_loss"] == pytest.approx(reference["val_loss"], abs=1e-5)
    assert resumed["train_loss"] == pytest.approx(reference["train_loss"], abs=1e-5)
