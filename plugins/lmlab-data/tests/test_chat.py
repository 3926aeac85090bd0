"""chat: each record one Conversation, from OpenAI's messages format or ShareGPT's conversations, in
JSONL, gzipped JSONL or a JSON array; bad records stop naming file, line and message, or are skipped
and counted. (How the preparation writes a Conversation out with a chat template and masks it is
checked in the core's tests/test_chat_data.py.)"""

import gzip
import json

import pytest

from lmlab.api import Conversation, Message, UserError
from lmlab.testing import check_data, check_plugin_class
from lmlab_data.chat import Chat, ChatOptions

CHATS = [
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello."}]},
    {"conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"},
                       {"from": "human", "value": "and 3+3?"}, {"from": "gpt", "value": "6"}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "Parts "}, {"type": "text", "text": "joined"}]},
                  {"role": "assistant", "content": "Yes."}]},
]


def read(path, **options):
    source = Chat(ChatOptions(path=str(path), **options))
    return list(source.documents()), source


def test_meets_the_plugin_contract_and_the_data_conformance_kit(tmp_path):
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(c) + "\n" for c in CHATS))
    check_plugin_class(Chat, "data", {"path": str(tmp_path / "c.jsonl")})
    check_data(Chat, {"path": str(tmp_path / "c.jsonl")})
    (tmp_path / "c.json").write_text(json.dumps(CHATS + [{"messages": []}]))
    check_data(Chat, {"path": str(tmp_path / "c.json"), "bad_record": "skip"})


def test_both_formats_become_conversations_of_roles(tmp_path):
    with gzip.open(tmp_path / "c.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(c) + "\n" for c in CHATS))
    docs, _ = read(tmp_path / "c.jsonl.gz")
    assert docs == [
        Conversation((Message("system", "Be brief."), Message("user", "Hi"), Message("assistant", "Hello."))),
        Conversation((Message("user", "2+2?"), Message("assistant", "4"), Message("user", "and 3+3?"),
                      Message("assistant", "6"))),
        Conversation((Message("user", "Parts joined"), Message("assistant", "Yes."))),
    ]
    assert docs[0].as_dicts()[1] == {"role": "user", "content": "Hi"}


@pytest.mark.parametrize("record, why", [
    ({"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]},
     "message 2 has role 'bot'; roles are system, user, assistant"),
    ({"conversations": [{"from": "robot", "value": "a"}]}, "message 1 has from 'robot'; roles are system, human, gpt"),
    ({"messages": [{"role": "user", "content": "a"}]}, "no assistant turn"),
    ({"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "b"}]},
     "message 1's content is not text"),
    ({"text": "plain"}, 'no list of "messages"'),
    ([1, 2], "a list, not an object"),
])
def test_a_bad_record_names_file_line_and_message_or_is_skipped(tmp_path, record, why):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps(CHATS[0]) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(UserError) as caught:
        read(path)
    assert caught.value.key == "data.path" and f"{path}:2: {why}" in str(caught.value)
    docs, source = read(path, bad_record="skip")
    assert len(docs) == 1 and source.stats() == {"records_skipped": 1}


def test_its_own_template_is_offered_to_the_preparation(tmp_path):
    (tmp_path / "c.jsonl").write_text(json.dumps(CHATS[0]) + "\n")
    template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    assert Chat(ChatOptions(path=str(tmp_path / "c.jsonl"), template=template)).conversation_template() == template
    assert Chat(ChatOptions(path=str(tmp_path / "c.jsonl"))).conversation_template() is None
