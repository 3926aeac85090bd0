"""JSON Lines files as documents: one JSON object per line, its text in one field.

The format of most pre-training dumps (The Pile, RedPajama, Dolma: ``{"text": ..., "meta": ...}``),
read line by line, so a file larger than memory works; ``.gz`` files are decompressed as they are
read. ``text_field`` may be a dotted path into nested objects (``"content.body"``). Blank lines are
ignored. A line that is not JSON, or has no string at ``text_field``, stops the preparation with the
file and line number (``bad_line = "fail"``), or is skipped and counted (``"skip"``:
``lines_skipped`` in the summary's ``data.source``).
"""

import json
from pathlib import Path
from typing import Any, Iterator, Literal

from lmlab.api import Field, UserError
from lmlab_data.files import READ_ERRORS, FileSource, FilesOptions, open_text, read_error


class JsonlOptions(FilesOptions):
    text_field: str = Field("text", min_length=1, help="the field holding the text; a dotted path for nested objects")
    bad_line: Literal["fail", "skip"] = Field(
        "fail", help='a line that is not JSON or lacks the text field: "fail" stops naming file and line, '
                     '"skip" leaves it out')


class Jsonl(FileSource):
    Options = JsonlOptions
    yields_records = False  # API 1.6: what an objective can check before reading
    api = ">=1.6,<2"  # yields_records; stats (1.3)

    def __init__(self, options: JsonlOptions | None = None):
        super().__init__(options)
        self.lines_skipped = self.files_skipped = 0

    def documents(self) -> Iterator[str]:
        self.lines_skipped = self.files_skipped = 0
        o = self.options
        for path in self.files():
            try:
                with open_text(path, o.encoding) as f:
                    for number, line in enumerate(f, 1):
                        if not line.strip():
                            continue
                        text = self._text(path, number, line)
                        if text is not None:
                            yield text
            except READ_ERRORS as exc:
                if o.bad_file == "fail":
                    raise read_error(path, o.encoding, exc) from exc
                self.files_skipped += 1

    def _text(self, path: Path, number: int, line: str) -> str | None:
        try:
            value = lookup(json.loads(line), self.options.text_field)
        except json.JSONDecodeError as exc:
            return self._bad(path, number, f"not JSON ({exc.msg}, column {exc.colno})")
        except LookupError:
            return self._bad(path, number, f"no field {self.options.text_field!r}")
        if not isinstance(value, str):
            return self._bad(path, number, f"field {self.options.text_field!r} is a {type(value).__name__}, "
                                           "not a string")
        return value

    def _bad(self, path: Path, number: int, why: str) -> None:
        if self.options.bad_line == "fail":
            raise UserError(f"{path}:{number}: {why}; set bad_line = \"skip\" to skip such lines",
                            key="data.path")
        self.lines_skipped += 1
        return None


    def stats(self) -> dict[str, int]:
        counts = {"lines_skipped": self.lines_skipped, "files_skipped": self.files_skipped}
        return {k: v for k, v in counts.items() if v}


def lookup(record: Any, dotted: str) -> Any:
    """``record["a"]["b"]`` for ``"a.b"``; LookupError when a step is missing or not an object."""
    for step in dotted.split("."):
        if not isinstance(record, dict) or step not in record:
            raise LookupError(dotted)
        record = record[step]
    return record
