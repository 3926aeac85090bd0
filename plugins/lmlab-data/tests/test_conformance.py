"""text-file, jsonl and alpaca pass lmlab's conformance kit for the data slot, on small files written here:
one file and several, a separator, lines and records skipped (and counted), .json and .jsonl."""

import gzip
import json

from lmlab.testing import check_data
from lmlab_data.alpaca import Alpaca
from lmlab_data.jsonl import Jsonl
from lmlab_data.text_file import TextFile

RECORDS = [{"instruction": "Name a colour.", "input": "", "output": "Blue."},
           {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"}]


def test_text_file_conforms(tmp_path):
    (tmp_path / "a.txt").write_text("The first file.\nIts second line.\n")
    (tmp_path / "b.txt").write_text("one<|endoftext|>two<|endoftext|>three")
    (tmp_path / "empty.txt").write_text("")
    check_data(TextFile, {"path": str(tmp_path / "a.txt")})
    check_data(TextFile, {"path": str(tmp_path / "*.txt"), "separator": "<|endoftext|>"})
    # A file that does not decode, skipped and counted: read in parts (one file each), the same.
    (tmp_path / "c.txt").write_bytes(b"fine<|endoftext|>\xff\xfe broken")
    check_data(TextFile, {"path": str(tmp_path / "*.txt"), "separator": "<|endoftext|>", "bad_file": "skip"})


def test_jsonl_conforms(tmp_path):
    lines = [json.dumps({"text": "first"}), "", "not json", json.dumps({"meta": {"body": "nested"}, "text": "second"})]
    (tmp_path / "a.jsonl").write_text("\n".join(lines) + "\n")
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.write(json.dumps({"text": "compressed"}) + "\n")
    check_data(Jsonl, {"path": [str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl.gz")], "bad_line": "skip"})
    check_data(Jsonl, {"path": str(tmp_path / "a.jsonl"), "text_field": "meta.body", "bad_line": "skip"})


def test_alpaca_conforms(tmp_path):
    (tmp_path / "data.json").write_text(json.dumps(RECORDS))
    (tmp_path / "data.jsonl").write_text("\n".join(map(json.dumps, [*RECORDS, {"instruction": 1}])) + "\n")
    check_data(Alpaca, {"path": str(tmp_path / "data.json")})
    check_data(Alpaca, {"path": str(tmp_path / "data.jsonl"), "template": "compact", "bad_record": "skip",
                        "response_end": "\n"})
