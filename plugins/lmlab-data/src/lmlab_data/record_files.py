"""What the sources of JSON records share (``alpaca``, ``preferences``): a ``.json`` file is one array
of records, loaded whole; a ``.jsonl`` file (or ``.jsonl.gz``) one record per line, streamed. A record
a subclass cannot use stops the preparation naming the file and line or record number
(``bad_record = "fail"``), or is skipped and counted (``"skip"``); an unreadable file likewise with
``bad_file``."""

import json
from pathlib import Path
from typing import Any, Iterator

from lmlab.api import Conversation, Record, UserError
from lmlab_data.files import READ_ERRORS, FileSource, open_text, read_error


class RecordFileSource(FileSource):
    """A FileSource of JSON records; subclasses turn one parsed record into a Record or a Conversation
    (``_record``)."""

    def __init__(self, options=None):
        super().__init__(options)
        self.records_skipped = self.files_skipped = 0

    def _record(self, raw: Any, where: str) -> Record | Conversation | None:
        """The document of one parsed JSON value, or ``self._bad(where, why)``."""
        raise NotImplementedError

    def documents(self) -> Iterator[Record | Conversation]:
        self.records_skipped = self.files_skipped = 0
        o = self.options
        for path in self.files():
            try:
                yield from self._file(path)
            except READ_ERRORS as exc:
                if o.bad_file == "fail":
                    raise read_error(path, o.encoding, exc) from exc
                self.files_skipped += 1

    def _file(self, path: Path) -> Iterator[Record | Conversation]:
        with open_text(path, self.options.encoding) as f:
            if path.name.endswith((".json", ".json.gz")):
                try:
                    records = json.load(f)
                except json.JSONDecodeError as exc:
                    raise UserError(f"{path}:{exc.lineno}: not JSON ({exc.msg}, column {exc.colno})",
                                    key="data.path") from exc
                if not isinstance(records, list):
                    raise UserError(f"{path}: a .json file must hold a list of records; use .jsonl for one record "
                                    "per line", key="data.path")
                for number, raw in enumerate(records, 1):
                    if (record := self._record(raw, f"{path}: record {number}")) is not None:
                        yield record
                return
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}:{number}"
                try:
                    raw = json.loads(line)
                except json.JSONDecodeError as exc:
                    self._bad(where, f"not JSON ({exc.msg}, column {exc.colno})")
                    continue
                if (record := self._record(raw, where)) is not None:
                    yield record

    def _bad(self, where: str, why: str) -> None:
        if self.options.bad_record == "fail":
            raise UserError(f"{where}: {why}; set bad_record = \"skip\" to skip such records", key="data.path")
        self.records_skipped += 1
        return None

    def stats(self) -> dict[str, int]:
        counts = {"records_skipped": self.records_skipped, "files_skipped": self.files_skipped}
        return {k: v for k, v in counts.items() if v}
