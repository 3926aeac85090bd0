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

from typing import Any, Literal

from pydantic import field_validator

from lmlab.api import ChatTemplate, Field, Record
from lmlab_data.files import FilesOptions
from lmlab_data.record_files import RecordFileSource

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


class Alpaca(RecordFileSource):
    Options = AlpacaOptions
    yields_records = True  # API 1.6: what an objective can check before reading
    api = ">=1.8,<2"  # chat_template

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
