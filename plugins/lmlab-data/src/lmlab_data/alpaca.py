"""Instruction-tuning records in the Alpaca format, as prompt/response Records.

Stanford Alpaca (Taori et al. 2023, https://github.com/tatsu-lab/stanford_alpaca) released 52K
records of ``{"instruction", "input", "output"}`` (``input`` may be empty) and trained on them with a
fixed prompt; the model learns to produce ``output`` given the prompt, so the loss counts only the
response tokens. Each record becomes an ``lmlab.api.Record`` of an unscored prompt segment (the
template filled with ``instruction`` and ``input``) and a scored response segment (``output``):
``lmlab prepare`` writes the loss mask from it, which the ``sft`` objective uses, while
``causal-lm`` trains on the whole text. The default templates (``template = "alpaca"``) are Alpaca's,
with the newline after ``### Response:`` that alpaca-lora's template adds (the released ``train.py``
joins prompt and output with nothing between them). ``template = "compact"`` is a short one of plain
letters, colons, spaces and newlines (``Instruction: ...\nInput: ...\nResponse: ``), with no '#' or
digit, so that a character tokenizer fitted on ordinary prose (tinyshakespeare) can encode it; the
``prompt_template`` options replace either.

A ``.json`` file is one JSON array of records (as ``alpaca_data.json``), loaded whole; a ``.jsonl``
file (or ``.jsonl.gz``) is one record per line, streamed. A record that is not an object with string
``instruction`` and ``output`` fields (``input`` is optional) stops the preparation naming the file
and line or record number (``bad_record = "fail"``), or is skipped and counted.
"""

import json
from pathlib import Path
from typing import Any, Iterator, Literal

from pydantic import field_validator

from lmlab.api import ChatTemplate, Field, Record, UserError
from lmlab_data.files import READ_ERRORS, FileSource, FilesOptions, open_text, read_error

PROMPT_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)
COMPACT_INPUT = "Instruction: {instruction}\nInput: {input}\nResponse: "
COMPACT_NO_INPUT = "Instruction: {instruction}\nResponse: "

#: template name → (prompt with input, prompt without input)
TEMPLATES = {"alpaca": (PROMPT_INPUT, PROMPT_NO_INPUT), "compact": (COMPACT_INPUT, COMPACT_NO_INPUT)}


class AlpacaOptions(FilesOptions):
    template: Literal["alpaca", "compact"] = Field(
        "alpaca", help='the prompts: "alpaca" (Alpaca\'s, with ### headings) or "compact" ("Instruction: ...\\n'
                       'Input: ...\\nResponse: ", letters and punctuation only, for character tokenizers)')
    prompt_template: str | None = Field(None, help="the prompt of a record with an input: {instruction} and "
                                                   "{input} are replaced by the record's fields; unset: the "
                                                   "template's")
    prompt_template_no_input: str | None = Field(None, help="the prompt of a record whose input is empty "
                                                            "({instruction} is replaced); unset: the template's")
    response_end: str = Field(
        "", help='text appended to every response, scored with it, so the model learns where an answer ends: '
                 'e.g. "\\n" for a tokenizer without an end-of-document token (char, byte); tokenizers with one '
                 'get it after every record anyway')
    bad_record: Literal["fail", "skip"] = Field(
        "fail", help='a record that is not JSON or lacks a field: "fail" stops naming file and line, "skip" '
                     'leaves it out')

    @field_validator("prompt_template", "prompt_template_no_input")
    @classmethod
    def _names_the_instruction(cls, value: str | None) -> str | None:
        if value is not None and "{instruction}" not in value:
            raise ValueError("must contain {instruction}")
        return value


class Alpaca(FileSource):
    Options = AlpacaOptions
    yields_records = True  # API 1.6: what an objective can check before reading
    api = ">=1.8,<2"  # chat_template

    def __init__(self, options: AlpacaOptions | None = None):
        super().__init__(options)
        self.records_skipped = self.files_skipped = 0

    def documents(self) -> Iterator[Record]:
        self.records_skipped = self.files_skipped = 0
        o = self.options
        for path in self.files():
            try:
                yield from self._file(path)
            except READ_ERRORS as exc:
                if o.bad_file == "fail":
                    raise read_error(path, o.encoding, exc) from exc
                self.files_skipped += 1

    def _file(self, path: Path) -> Iterator[Record]:
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

    def _record(self, raw: Any, where: str) -> Record | None:
        if not isinstance(raw, dict):
            return self._bad(where, f"a {type(raw).__name__}, not an object")
        for name in ("instruction", "output"):
            if not isinstance(raw.get(name), str):
                return self._bad(where, f"no string field {name!r}")
        given = raw.get("input") or ""
        if not isinstance(given, str):
            return self._bad(where, "field 'input' is not a string")
        prompt = self.chat_template().render(raw["instruction"], given)
        return Record.prompt_response(prompt, raw["output"] + self.options.response_end)

    def chat_template(self) -> ChatTemplate:
        o = self.options
        with_input, without_input = TEMPLATES[o.template]
        return ChatTemplate(prompt=o.prompt_template if o.prompt_template is not None else with_input,
                            prompt_no_input=(o.prompt_template_no_input if o.prompt_template_no_input is not None
                                             else without_input),
                            stop=o.response_end or None)

    def _bad(self, where: str, why: str) -> None:
        if self.options.bad_record == "fail":
            raise UserError(f"{where}: {why}; set bad_record = \"skip\" to skip such records",
                            key="data.path")
        self.records_skipped += 1
        return None


    def stats(self) -> dict[str, int]:
        counts = {"records_skipped": self.records_skipped, "files_skipped": self.files_skipped}
        return {k: v for k, v in counts.items() if v}
