"""preferences: each pair one Record (prompt 0, chosen 1, rejected 2) from JSONL, gzipped JSONL or a JSON
array, with a prompt field, its aliases or an HH-style shared prefix; bad records stop the
preparation naming file and line, or are skipped and counted; and from a manifest, a bad file is one
line and exit status 2. (That `lmlab prepare` writes the mask values 0, 1, 2 is checked in the core's
tests/test_shakespeare_preferences.py, which may read the token cache.)"""

import gzip
import json
import os
import subprocess
import sys

import pytest

from lmlab.api import Record, Segment, UserError
from lmlab.testing import check_data, check_plugin_class
from lmlab_data.preferences import Preferences, PreferencesOptions, split_shared_prompt

PAIRS = [
    {"prompt": "Who speaks this line?\nO Romeo, Romeo!\n", "chosen": "JULIET", "rejected": "NURSE"},
    {"prompt": "Which word comes next?\nA horse! a ", "chosen": "horse", "rejected": "kingdom"},
]


def source(**options):
    return Preferences(PreferencesOptions(**options))


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def segments(record: Record):
    return [(s.text, s.mask_value) for s in record.segments]


def test_meets_the_plugin_contract_and_the_data_conformance_kit(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", PAIRS)
    check_plugin_class(Preferences, "data", {"path": str(path)})
    check_data(Preferences, {"path": str(path)})
    (tmp_path / "p.json").write_text(json.dumps(PAIRS + [{"prompt": "x"}]))
    check_data(Preferences, {"path": str(tmp_path / "p.json"), "bad_record": "skip", "response_end": "\n"})
    assert Preferences.yields_records is True


def test_a_pair_is_one_record_of_prompt_chosen_and_rejected(tmp_path):
    first, second = source(path=str(write_jsonl(tmp_path / "p.jsonl", PAIRS))).documents()
    assert first == Record((Segment("Who speaks this line?\nO Romeo, Romeo!\n", scored=False),
                            Segment("JULIET", label=1), Segment("NURSE", label=2)))
    assert segments(second) == [("Which word comes next?\nA horse! a ", 0), ("horse", 1), ("kingdom", 2)]


def test_gzipped_jsonl_and_json_arrays_read_the_same(tmp_path):
    with gzip.open(tmp_path / "p.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in PAIRS))
    (tmp_path / "p.json").write_text(json.dumps(PAIRS, indent=1))
    plain = list(source(path=str(write_jsonl(tmp_path / "p.jsonl", PAIRS))).documents())
    assert list(source(path=str(tmp_path / "p.jsonl.gz")).documents()) == plain
    assert list(source(path=str(tmp_path / "p.json")).documents()) == plain


def test_aliases_name_the_same_fields(tmp_path):
    rows = [{"question": "Q?", "response_chosen": "yes", "response_rejected": "no"},
            {"prompt": "P?", "chosen_response": "good", "rejected_response": "bad"}]
    first, second = source(path=str(write_jsonl(tmp_path / "a.jsonl", rows))).documents()
    assert segments(first) == [("Q?", 0), ("yes", 1), ("no", 2)]
    assert segments(second) == [("P?", 0), ("good", 1), ("bad", 2)]


def test_without_a_prompt_the_shared_start_of_both_texts_is_the_prompt_cut_at_a_word(tmp_path):
    # Anthropic HH-RLHF: whole conversations; the answers differ after "Assistant: S".
    conversation = "\n\nHuman: Can you help me?\n\nAssistant: "
    rows = [{"chosen": conversation + "Sure, gladly.", "rejected": conversation + "Sorry, no."}]
    (record,) = source(path=str(write_jsonl(tmp_path / "hh.jsonl", rows))).documents()
    assert segments(record) == [(conversation, 0), ("Sure, gladly.", 1), ("Sorry, no.", 2)]


@pytest.mark.parametrize("chosen, rejected, expected", [
    ("Q: yes", "Q: no", ("Q: ", "yes", "no")),
    ("Q: I think so", "Q: I doubt it", ("Q: I ", "think so", "doubt it")),
    ("Q:\nline one", "Q:\nlines", ("Q:\n", "line one", "lines")),  # the shared "line" is cut back
    ("Q: yes", "Q: yes indeed", ("Q: ", "yes", "yes indeed")),  # one text is the other's start
    ("Q: A ", "Q: A B", ("Q: ", "A ", "A B")),
    ("yes", "no", ("", "yes", "no")),  # nothing shared
])
def test_the_shared_prompt_never_splits_a_word_nor_empties_an_answer(chosen, rejected, expected):
    prompt, a, b = split_shared_prompt(chosen, rejected)
    assert (prompt, a, b) == expected and prompt + a == chosen and prompt + b == rejected


def test_prompt_template_and_response_end(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", PAIRS[:1])
    (record,) = source(path=str(path), prompt_template="Question: {prompt}Answer: ", response_end="\n").documents()
    assert segments(record) == [("Question: Who speaks this line?\nO Romeo, Romeo!\nAnswer: ", 0),
                                ("JULIET\n", 1), ("NURSE\n", 2)]
    template = source(path=str(path), prompt_template="Q: {prompt}\nA: ", response_end="\n").chat_template()
    assert template.render("Who?") == "Q: Who?\nA: " and template.stop == "\n"


def test_a_template_without_the_prompt_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"\{prompt\}"):
        PreferencesOptions(path=str(write_jsonl(tmp_path / "p.jsonl", PAIRS)), prompt_template="no placeholder")


@pytest.mark.parametrize("bad, message", [
    ({"prompt": "p", "chosen": "a"}, "the record has no 'rejected' (a preference record needs prompt, chosen and rejected)"),
    ({"prompt": "p", "rejected": "a"}, "the record has no 'chosen'"),
    ({"prompt": "p", "chosen": ["a"], "rejected": "b"}, "'chosen' is a list, not a string"),
    ({"prompt": None, "chosen": "a", "rejected": "b"}, "'prompt' is null, not a string"),
    ({"prompt": "p", "chosen": "a", "rejected": " "}, "'rejected' is empty"),
    ({"prompt": "p", "chosen": "same", "rejected": "same"}, "'chosen' and 'rejected' are the same text"),
    ({"chosen": "Q: same", "rejected": "Q: same"}, "'chosen' and 'rejected' are the same text"),
    (["p", "a", "b"], "a list, not an object"),
])
def test_a_bad_jsonl_record_names_file_line_and_field(tmp_path, bad, message):
    path = tmp_path / "x.jsonl"
    path.write_text(json.dumps(PAIRS[0]) + "\n\n" + json.dumps(bad) + "\n")
    with pytest.raises(UserError) as caught:
        list(source(path=str(path)).documents())
    assert str(caught.value).startswith(f"data.path: {path}:3: {message}")


def test_a_bad_record_in_a_json_array_names_its_number(tmp_path):
    path = tmp_path / "x.json"
    path.write_text(json.dumps([PAIRS[0], {"question": "q", "chosen": "a"}]))
    with pytest.raises(UserError, match=r"x\.json: record 2: the record has no 'rejected'"):
        list(source(path=str(path)).documents())


def test_a_line_that_is_not_json_names_file_and_line(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text(json.dumps(PAIRS[0]) + "\n{oops\n")
    with pytest.raises(UserError, match=r"x\.jsonl:2: not JSON"):
        list(source(path=str(path)).documents())


def test_bad_record_skip_skips_and_counts(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text("\n".join([json.dumps(PAIRS[0]), "nope", json.dumps({"prompt": "p", "chosen": "a"}),
                               json.dumps({"prompt": "p", "chosen": "a", "rejected": "a"}), json.dumps(PAIRS[1])]))
    plugin = source(path=str(path), bad_record="skip")
    assert [r.segments[1].text for r in plugin.documents()] == ["JULIET", "horse"]
    assert plugin.stats() == {"records_skipped": 3}


# --- from a manifest -------------------------------------------------------------------------------

MANIFEST = """
name = "prefs-tiny"
seed = 1

[data]
use = "preferences"
path = "{path}"
response_end = "\\n"

[tokenizer]
use = "char"

[model]
n_layers = 1
d_model = 16
n_heads = 2
block_size = 32

[objective]
use = "causal-lm"

[train]
max_steps = 2
batch_size = 2
warmup_steps = 1
eval_every = 2
eval_steps = 1
sample_tokens = 0

[tracker]
use = "none"
"""


def pair_rows(n: int) -> list[dict]:
    names = ["ROMEO", "JULIET", "NURSE", "TYBALT", "MERCUTIO"]
    return [{"prompt": f"Who speaks line {'abcde'[i % 5]}?\n", "chosen": names[i % 5], "rejected": names[(i + 1) % 5]}
            for i in range(n)]


def cli(*args, cache):
    return subprocess.run([sys.executable, "-m", "lmlab", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "LMLAB_CACHE": str(cache),
                               "WANDB_MODE": "offline"})


def test_a_record_without_rejected_stops_the_run_with_one_line_naming_file_and_line(tmp_path):
    data = tmp_path / "pairs.jsonl"
    rows = pair_rows(12)
    del rows[2]["rejected"]
    write_jsonl(data, rows)
    manifest = tmp_path / "prefs.toml"
    manifest.write_text(MANIFEST.replace("{path}", data.name))
    assert cli("check", str(manifest), cache=tmp_path / "cache").returncode == 0  # the manifest alone is fine
    result = cli("run", str(manifest), "--out", str(tmp_path / "runs"), cache=tmp_path / "cache")
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("lmlab: error:")]
    assert errors == [f"lmlab: error: data.path: {data}:3: the record has no 'rejected' (a preference record "
                      "needs prompt, chosen and rejected); set bad_record = \"skip\" to skip such records"]
    tokens = tmp_path / "cache" / "tokens"
    assert not tokens.exists() or not any(tokens.iterdir())  # nothing a later run could take for prepared
