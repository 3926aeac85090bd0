import gzip
import json

import pytest

from lmlab.api import UserError
from lmlab.testing import check_plugin_class
from lmlab_data.jsonl import Jsonl


def source(**options):
    return Jsonl(Jsonl.Options(**options))


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text('{"text": "first", "meta": 1}\n\n{"text": "second"}\n', encoding="utf-8")
    return path


def test_meets_the_plugin_contract(corpus):
    check_plugin_class(Jsonl, "data", {"path": str(corpus)})


def test_one_document_per_line_from_the_text_field_blank_lines_ignored(corpus):
    assert list(source(path=corpus).documents()) == ["first", "second"]


def test_text_field_may_be_a_dotted_path(tmp_path):
    path = tmp_path / "nested.jsonl"
    path.write_text(json.dumps({"content": {"body": "deep"}}) + "\n")
    assert list(source(path=path, text_field="content.body").documents()) == ["deep"]


def test_gzip_files_are_streamed(tmp_path):
    path = tmp_path / "c.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write('{"text": "zipped"}\n')
    assert list(source(path=path).documents()) == ["zipped"]


def test_a_line_that_is_not_json_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n{"text": oops}\n')
    with pytest.raises(UserError, match=r"bad\.jsonl:2: not JSON .*bad_line = \"skip\""):
        list(source(path=path).documents())


def test_a_missing_or_non_string_field_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"body": "x"}\n')
    with pytest.raises(UserError, match=r"bad\.jsonl:1: no field 'text'"):
        list(source(path=path).documents())
    path.write_text('{"text": 3}\n')
    with pytest.raises(UserError, match=r"bad\.jsonl:1: field 'text' is a int, not a string"):
        list(source(path=path).documents())


def test_bad_line_skip_skips_and_counts(tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_text('{"text": "a"}\nnot json\n[1, 2]\n{"text": "b"}\n')
    plugin = source(path=path, bad_line="skip")
    assert list(plugin.documents()) == ["a", "b"]
    assert plugin.stats() == {"lines_skipped": 2}


def test_fingerprint_follows_the_contents(corpus):
    before = source(path=corpus).fingerprint()
    corpus.write_text('{"text": "changed"}\n')
    assert source(path=corpus).fingerprint() != before
