"""The shipped tasks' documents, read from the files beside this one (``custom_dataset`` of their YAML),
so that they load wherever lmlab is installed and whatever the working folder."""

import gzip
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _rows(name: str):
    import datasets

    with gzip.open(HERE / f"{name}.jsonl.gz", "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def next_line(**kwargs):
    return _rows("shakespeare_next_line")


def passages(**kwargs):
    return _rows("shakespeare_ppl")


def instructions(**kwargs):
    return _rows("shakespeare_instructions")
