import json

import pytest

from lmlab.api import Record, Segment, UserError
from lmlab.testing import check_plugin_class
from lmlab_data.alpaca import PROMPT_INPUT, PROMPT_NO_INPUT, Alpaca, AlpacaOptions

RECORDS = [
    {"instruction": "Give three tips for staying healthy.", "input": "", "output": "1. Eat well."},
    {"instruction": "Translate to French.", "input": "cheese", "output": "fromage"},
]


def source(**options):
    return Alpaca(Alpaca.Options(**options))


@pytest.fixture
def json_file(tmp_path):
    path = tmp_path / "alpaca_data.json"
    path.write_text(json.dumps(RECORDS))
    return path


def test_meets_the_plugin_contract(json_file):
    check_plugin_class(Alpaca, "data", {"path": str(json_file)})


def test_records_become_an_unscored_prompt_and_a_scored_response(json_file):
    first, second = source(path=json_file).documents()
    assert first == Record((Segment(PROMPT_NO_INPUT.replace("{instruction}", RECORDS[0]["instruction"]), False),
                            Segment("1. Eat well.", True)))
    prompt = PROMPT_INPUT.replace("{instruction}", "Translate to French.").replace("{input}", "cheese")
    assert second == Record.prompt_response(prompt, "fromage")
    assert second.text == prompt + "fromage"


def test_jsonl_files_hold_one_record_per_line(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n")
    assert [r.segments[1].text for r in source(path=path).documents()] == ["1. Eat well.", "fromage"]


def test_templates_are_options(json_file):
    plugin = source(path=json_file, prompt_template="Q: {instruction} ({input})\nA: ",
                    prompt_template_no_input="Q: {instruction}\nA: ")
    first, second = plugin.documents()
    assert first.segments[0].text == "Q: Give three tips for staying healthy.\nA: "
    assert second.segments[0].text == "Q: Translate to French. (cheese)\nA: "


def test_a_template_without_the_instruction_is_refused(json_file):
    with pytest.raises(ValueError, match=r"\{instruction\}"):
        Alpaca.Options(path=str(json_file), prompt_template="no placeholder")


def test_a_bad_jsonl_record_names_file_and_line(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(RECORDS[0]) + "\n{broken\n")
    with pytest.raises(UserError, match=r"data\.jsonl:2: not JSON"):
        list(source(path=path).documents())
    path.write_text(json.dumps({"instruction": "x"}) + "\n")
    with pytest.raises(UserError, match=r"data\.jsonl:1: no string field 'output'"):
        list(source(path=path).documents())


def test_a_bad_record_in_a_json_array_names_its_number(tmp_path):
    path = tmp_path / "data.json"
    path.write_text(json.dumps([RECORDS[0], {"output": "y"}]))
    with pytest.raises(UserError, match=r"data\.json: record 2: no string field 'instruction'"):
        list(source(path=path).documents())


def test_a_json_file_must_hold_a_list(tmp_path):
    path = tmp_path / "data.json"
    path.write_text(json.dumps(RECORDS[0]))
    with pytest.raises(UserError, match="must hold a list of records"):
        list(source(path=path).documents())


def test_bad_record_skip_skips_and_counts(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(RECORDS[0]) + "\nnope\n" + json.dumps({"instruction": 1, "output": "x"}) + "\n")
    plugin = source(path=path, bad_record="skip")
    assert len(list(plugin.documents())) == 1
    assert plugin.stats() == {"records_skipped": 2}


def test_the_compact_template_is_plain_letters_and_punctuation(json_file):
    first, second = source(path=json_file, template="compact").documents()
    assert first.segments[0].text == "Instruction: Give three tips for staying healthy.\nResponse: "
    assert second.segments[0].text == "Instruction: Translate to French.\nInput: cheese\nResponse: "
    assert second.segments[1] == Segment("fromage", True)


def test_the_compact_template_encodes_with_a_char_tokenizer_fitted_on_tinyshakespeare():
    from pathlib import Path

    from lmlab_data.alpaca import COMPACT_INPUT, COMPACT_NO_INPUT

    corpus = Path(__file__).resolve().parents[3] / "data" / "tinyshakespeare.txt"
    if not corpus.is_file():
        pytest.skip("no tinyshakespeare in this checkout")
    seen = set(corpus.read_text())
    for template in (COMPACT_INPUT, COMPACT_NO_INPUT):
        fixed = template.replace("{instruction}", "").replace("{input}", "")
        assert set(fixed) <= seen and not set(fixed) & set("#0123456789")


def test_an_explicit_prompt_template_overrides_the_named_one(json_file):
    _, second = source(path=json_file, template="compact", prompt_template="Q: {instruction} {input}\nA: ").documents()
    assert second.segments[0].text == "Q: Translate to French. cheese\nA: "


def test_response_end_is_appended_to_every_response_and_scored(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"instruction": "Say hi.", "output": "hi"}\n')
    (record,) = list(Alpaca(AlpacaOptions(path=str(path), template="compact", response_end="\n")).documents())
    assert [(s.text, s.scored) for s in record.segments] == [("Instruction: Say hi.\nResponse: ", False),
                                                              ("hi\n", True)]
