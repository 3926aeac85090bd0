"""Conversations in the messages format, for fine-tuning a chat model on its own chat template.

Each record is one conversation, as OpenAI's chat API and fine-tuning files write it,
``{"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]}``, or as
ShareGPT-style sets do, ``{"conversations": [{"from": "system" | "human" | "gpt", "value": "..."}]}``.
It becomes an ``lmlab.api.Conversation``: ``lmlab prepare`` writes it out with the model's own chat
template (the tokenizer's, from a pretrained model's files) and scores only the assistant's turns,
end-of-turn marker included, so ``objective.use = "sft"`` teaches the answers and never the
questions. ``template`` gives a Jinja template of one's own instead (for a tokenizer without one: a
character or byte tokenizer trained here); ``lmlab serve`` and ``lmlab generate --chat`` then chat
through it too.

A ``.json`` file is one JSON array of records, loaded whole; a ``.jsonl`` file (or ``.jsonl.gz``)
is one record per line, streamed. A record that is not an object with a list of messages, a message
with another role or a content that is not text, or a conversation without an assistant turn stops
the preparation naming the file and line or record number (``bad_record = "fail"``), or is skipped
and counted.
"""

from typing import Any, Literal

from lmlab.api import Conversation, Field, Message
from lmlab_data.files import FilesOptions
from lmlab_data.record_files import RecordFileSource

#: ShareGPT's speakers → OpenAI's roles
SPEAKERS = {"human": "user", "gpt": "assistant", "system": "system", "user": "user", "assistant": "assistant"}
ROLES = ("system", "user", "assistant")


class ChatOptions(FilesOptions):
    template: str | None = Field(
        None, help="a Jinja chat template (reading messages, add_generation_prompt) that writes the "
                   "conversations out; unset: the tokenizer's own, from the pretrained model's files")
    bad_record: Literal["fail", "skip"] = Field(
        "fail", help='a record that is not JSON, has a message of another role or no assistant turn: "fail" '
                     'stops naming file and line, "skip" leaves it out')


class Chat(RecordFileSource):
    Options = ChatOptions
    yields_records = True  # Conversations are written out as Records
    api = ">=1.21,<2"  # Conversation, conversation_template

    def _record(self, raw: Any, where: str) -> Conversation | None:
        if not isinstance(raw, dict):
            return self._bad(where, f"a {type(raw).__name__}, not an object")
        if isinstance(raw.get("messages"), list):
            turns, role_key, text_key = raw["messages"], "role", "content"
        elif isinstance(raw.get("conversations"), list):
            turns, role_key, text_key = raw["conversations"], "from", "value"
        else:
            return self._bad(where, 'no list of "messages" (or ShareGPT\'s "conversations")')
        messages = []
        for number, turn in enumerate(turns, 1):
            if not isinstance(turn, dict):
                return self._bad(where, f"message {number} is a {type(turn).__name__}, not an object")
            speaker = turn.get(role_key)
            role = SPEAKERS.get(speaker) if isinstance(speaker, str) else None
            if role is None:
                return self._bad(where, f"message {number} has {role_key} {speaker!r}; roles are "
                                        + ", ".join(ROLES if role_key == "role" else ("system", "human", "gpt")))
            content = _text(turn.get(text_key))
            if content is None:
                return self._bad(where, f"message {number}'s {text_key} is not text")
            messages.append(Message(role, content))
        if not any(m.role == "assistant" for m in messages):
            return self._bad(where, "no assistant turn: nothing to learn")
        return Conversation(tuple(messages))

    def conversation_template(self) -> str | None:
        return self.options.template


def _text(content) -> str | None:
    """A message's text: a string, or OpenAI's list of content parts whose parts are all text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    return None
