"""Preference pairs (a prompt, a chosen and a rejected answer) as Records, for preference objectives.

Direct Preference Optimization (Rafailov et al. 2023, https://arxiv.org/abs/2305.18290) and reward
models (as in Anthropic's HH-RLHF, Bai et al. 2022, https://arxiv.org/abs/2204.05862) learn from
pairs of answers to the same prompt, one preferred over the other. Each pair becomes ONE document:
an ``lmlab.api.Record`` of an unscored prompt segment, the chosen answer (label 1) and the rejected
answer (label 2), so that ``lmlab prepare`` writes a loss mask of 0 on the prompt, 1 on the chosen
and 2 on the rejected tokens; a preference objective (``dpo``, ``reward-model``) splits each row by
those values, compares the two answers given the prompt, and never mixes answers of different
pairs. ``causal-lm`` would train on the whole text, rejected answers included, which is rarely what
anyone wants from this data.

A record is ``{"prompt", "chosen", "rejected"}`` of strings (``question`` is taken for ``prompt``,
``response_chosen`` or ``chosen_response`` for ``chosen``, ``response_rejected`` or
``rejected_response`` for ``rejected``). A record without a prompt field is read as Anthropic's
HH-RLHF files are written: ``chosen`` and ``rejected`` are whole conversations that share the
prompt, which is taken as their longest common prefix cut back to just after a whitespace
character, so that neither answer starts in the middle of a word (a pair that differs only after
"Assistant: S" keeps "Sure" and "Sorry" whole). The prompt is put into ``prompt_template``;
``response_end`` is appended to both answers and scored with them.

A ``.json`` file is one JSON array of records, loaded whole; a ``.jsonl`` file (or ``.jsonl.gz``)
is one record per line, streamed. A record that is not an object, lacks ``chosen`` or ``rejected``,
holds a non-string or an empty answer, or whose two answers are the same text (it would teach
nothing, and the loss's margin is zero on it) stops the preparation naming the file and line or
record number (``bad_record = "fail"``), or is skipped and counted.
"""

import os
from typing import Any, Literal

from pydantic import field_validator

from lmlab.api import ChatTemplate, Field, Record, Segment
from lmlab_data.files import FilesOptions
from lmlab_data.record_files import RecordFileSource

#: field → the names a record may use for it, first found wins
ALIASES = {"prompt": ("prompt", "question"),
           "chosen": ("chosen", "response_chosen", "chosen_response"),
           "rejected": ("rejected", "response_rejected", "rejected_response")}
CHOSEN, REJECTED = 1, 2  # the loss mask's values on each answer's tokens; the prompt's is 0
NEEDS = "a preference record needs prompt, chosen and rejected"


class PreferencesOptions(FilesOptions):
    prompt_template: str = Field(
        "{prompt}", help="the prompt segment: {prompt} is replaced by the record's prompt (e.g. "
                         '"Question: {prompt}\\nAnswer: ")')
    response_end: str = Field(
        "", help='text appended to both answers, scored with them, so the model learns where an answer ends: '
                 'e.g. "\\n" for a tokenizer without an end-of-document token (char, byte)')
    bad_record: Literal["fail", "skip"] = Field(
        "fail", help='a record that is not JSON, lacks a field, has an empty answer or two equal answers: '
                     '"fail" stops naming file and line, "skip" leaves it out')

    @field_validator("prompt_template")
    @classmethod
    def _names_the_prompt(cls, value: str) -> str:
        if "{prompt}" not in value:
            raise ValueError("must contain {prompt}")
        return value


class Preferences(RecordFileSource):
    Options = PreferencesOptions
    yields_records = True
    api = ">=1.10,<2"  # Segment.label: the mask tells chosen from rejected

    def _record(self, raw: Any, where: str) -> Record | None:
        if not isinstance(raw, dict):
            return self._bad(where, f"a {type(raw).__name__}, not an object")
        fields = {}
        for field, names in ALIASES.items():
            name = next((n for n in names if n in raw), None)
            if name is None:
                if field != "prompt":
                    return self._bad(where, f"the record has no {field!r} ({NEEDS})")
                continue
            if not isinstance(raw[name], str):
                return self._bad(where, f"{name!r} is {_kind(raw[name])}, not a string ({NEEDS})")
            fields[field] = raw[name]
        chosen, rejected = fields["chosen"], fields["rejected"]
        if "prompt" in fields:
            prompt = fields["prompt"]
        else:
            prompt, chosen, rejected = split_shared_prompt(chosen, rejected)
        for field, answer in (("chosen", chosen), ("rejected", rejected)):
            if not answer.strip():
                return self._bad(where, f"{field!r} is empty ({NEEDS})")
        if chosen == rejected:
            return self._bad(where, "'chosen' and 'rejected' are the same text (a preference pair needs two "
                                    "different answers)")
        end = self.options.response_end
        return Record((Segment(self.options.prompt_template.replace("{prompt}", prompt), scored=False),
                       Segment(chosen + end, label=CHOSEN), Segment(rejected + end, label=REJECTED)))

    def chat_template(self) -> ChatTemplate:
        # A chat's user message is the prompt; a system message goes after it on its own line, as the
        # Shakespeare preference set joins instruction and input.
        template = self.options.prompt_template
        return ChatTemplate(prompt=template.replace("{prompt}", "{instruction}\n{input}"),
                            prompt_no_input=template.replace("{prompt}", "{instruction}"),
                            stop=self.options.response_end or None)


def _kind(value: Any) -> str:
    """A JSON value's type as the record's author wrote it."""
    if value is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", list: "a list", dict: "an object"}.get(
        type(value), f"a {type(value).__name__}")


def split_shared_prompt(chosen: str, rejected: str) -> tuple[str, str, str]:
    """(prompt, chosen answer, rejected answer) of two whole texts that share their prompt (HH-RLHF):
    the prompt is their longest common prefix, cut back to just after a whitespace character (or to
    nothing) so that both answers start at a word and neither is empty when the texts differ."""
    cut = len(os.path.commonprefix([chosen, rejected]))
    if cut == min(len(chosen), len(rejected)):
        # One text is the other's start: the shorter one's last word is its answer, not prompt.
        cut -= 1
    while cut > 0 and not chosen[cut - 1].isspace():
        cut -= 1
    cut = max(cut, 0)
    return chosen[:cut], chosen[cut:], rejected[cut:]
