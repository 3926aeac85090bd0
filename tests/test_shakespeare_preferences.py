"""The shipped preference set is what scripts/make_shakespeare_preferences.py writes, byte for byte on
every run, and its pairs are what it says: the instruction task's prompts and answers, each with a
different wrong answer of the same kind, held-out pairs only from held-out records. Read by the
`preferences` data plugin, `lmlab prepare` gives each pair's prompt, chosen and rejected tokens the
mask values 0, 1 and 2 that the preference objectives split rows by."""

import collections
import gzip
import importlib.util
import json
import re
from pathlib import Path

import numpy as np

from lmlab import manifest
from lmlab.prepare import tokens as token_cache

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "data" / "shakespeare-prefs"
SFT = ROOT / "data" / "shakespeare-sft"
NAMES = ("train.jsonl.gz", "heldout.jsonl.gz")


def load(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def generator():
    spec = importlib.util.spec_from_file_location("make_shakespeare_preferences",
                                                  ROOT / "scripts" / "make_shakespeare_preferences.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_script_writes_the_shipped_files_byte_for_byte_every_time(tmp_path, capsys):
    make = generator()
    for attempt in ("first", "second"):
        make.main(["--out", str(tmp_path / attempt)])
    assert "train.jsonl.gz: 15407 pairs (finish-word 4248, next-word 5579, speaker 5580)" in capsys.readouterr().out
    for name in NAMES:
        first = (tmp_path / "first" / name).read_bytes()
        assert first == (tmp_path / "second" / name).read_bytes() == (SHIPPED / name).read_bytes(), name


def test_every_pair_is_an_instruction_record_with_a_different_wrong_answer_of_its_kind():
    corpus = (ROOT / "data" / "tinyshakespeare.txt").read_text()
    words, characters = set(re.findall(r"[A-Za-z']+", corpus)), set(corpus)
    for name in NAMES:
        pairs, records = load(SHIPPED / name), load(SFT / name)
        assert len(pairs) == len(records)
        speakers = {r["output"] for r in records if r["task"] == "speaker"}
        for pair, record in zip(pairs, records, strict=True):
            assert set(pair) == {"task", "prompt", "chosen", "rejected"}
            assert pair["task"] == record["task"] and pair["chosen"] == record["output"]
            assert pair["prompt"] == f"{record['instruction']}\n{record['input']}"
            assert pair["rejected"] and pair["rejected"] != pair["chosen"]
            assert set(pair["prompt"] + pair["chosen"] + pair["rejected"]) <= characters
            if pair["task"] == "speaker":
                assert pair["rejected"] in speakers  # drawn from this split's own speakers
            elif pair["task"] == "next-word":
                assert pair["rejected"] in words and pair["rejected"][0].isupper() == pair["chosen"][0].isupper()
            else:
                assert re.fullmatch(r"[A-Za-z']+", pair["rejected"])


def test_held_out_prompts_are_training_prompts_only_where_the_corpus_repeats_them():
    train, heldout = load(SHIPPED / "train.jsonl.gz"), load(SHIPPED / "heldout.jsonl.gz")
    seen = {pair["prompt"] for pair in train}
    shared = collections.Counter(pair["task"] for pair in heldout if pair["prompt"] in seen)
    # Repeated lines and line openings ("Which word comes next?\nOf the "): 29 of 1,727 when written.
    assert sum(shared.values()) < 0.02 * len(heldout), shared


def test_prepare_masks_each_pairs_prompt_chosen_and_rejected_with_0_1_and_2(tmp_path):
    pairs = load(SHIPPED / "heldout.jsonl.gz")[:30]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(pair) + "\n" for pair in pairs))
    path = tmp_path / "prefs.toml"
    path.write_text(f'name = "prefs"\n\n[data]\nuse = "preferences"\npath = "{data.name}"\nresponse_end = "\\n"\n\n'
                    '[tokenizer]\nuse = "char"\n\n[tracker]\nuse = "none"\n')
    (variant,) = manifest.load(path)
    prepared = token_cache.load_tokens(variant, root=tmp_path / "cache")
    assert prepared.index["masked"] and prepared.train_mask.dtype == np.uint8
    # The char tokenizer has no end-of-document token: each pair follows the one before; every tenth
    # pair (the 10th, 20th, 30th) is a validation document.
    text, mask = "", []
    for pair in (pair for i, pair in enumerate(pairs) if i % 10 != 9):
        for part, value in ((pair["prompt"], 0), (pair["chosen"] + "\n", 1), (pair["rejected"] + "\n", 2)):
            text += part
            mask += [value] * len(part)
    assert prepared.tokenizer.decode(np.asarray(prepared.train)) == text
    np.testing.assert_array_equal(np.asarray(prepared.train_mask), mask)
    assert len(prepared.val_mask) == len(prepared.val) and set(np.unique(prepared.val_mask)) == {0, 1, 2}
