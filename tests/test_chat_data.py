"""Conversations (the ``chat`` data plugin) prepared through a chat template: the tokens are those of
transformers' ``apply_chat_template``, and the loss mask marks exactly the tokens transformers marks
as the assistant's (``return_assistant_tokens_mask``, from the template's ``{% generation %}``
blocks), though lmlab works the marking out without them. A template of the data source's own
serves a tokenizer without one. Bad input is one line and exit status 2."""

import json
from pathlib import Path

import numpy as np
import pytest

from lmlab import manifest
from lmlab.cli.main import main
from lmlab.prepare import tokens as token_cache
from support import hf_folder, refused, run_cli

transformers = pytest.importorskip("transformers")

# ChatML, as SmolLM2 and Qwen write it, with the assistant's text in a generation block so that
# transformers can say which tokens are the assistant's.
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
          "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' + '\\n' }}"
          "{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' + '\\n' }}{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
PLAIN = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"


def conversations(n: int) -> list[list[dict]]:
    out = []
    for i in range(n):
        chat = [{"role": "system", "content": "Answer in one word."}] if i % 3 == 0 else []
        chat += [{"role": "user", "content": f"What follows {i}?"}, {"role": "assistant", "content": f"{i + 1}."}]
        if i % 2:
            chat += [{"role": "user", "content": "And then?"}, {"role": "assistant", "content": f"{i + 2}, then more."}]
        out.append(chat)
    return out


def write_manifest(tmp_path, data: str, tokenizer: str, extra: str = "") -> str:
    path = tmp_path / "chat.toml"
    path.write_text(f'name = "chat"\n\n[data]\nuse = "chat"\npath = "chats.jsonl"\n{data}\n\n[tokenizer]\n{tokenizer}\n\n'
                    f'[model]\nn_layers = 1\nd_model = 32\nn_heads = 2\nblock_size = 64\n\n[objective]\nuse = "sft"\n\n'
                    f'[train]\nmax_steps = 2\nbatch_size = 2\neval_every = 2\neval_steps = 1\nsample_tokens = 0\n\n'
                    f'[tracker]\nuse = "none"\n{extra}')
    return str(path)


def write_chats(tmp_path, chats) -> None:
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))


def test_tokens_and_assistant_mask_are_transformers(tmp_path):
    text = " ".join(f"What follows {i}? {i + 1}. And then? {i + 2}, then more. Answer in one word." for i in range(40))
    folder, _ = hf_folder(tmp_path, text, chat_template=CHATML)
    chats = conversations(20)
    write_chats(tmp_path, chats)
    (variant,) = manifest.load(write_manifest(tmp_path, "", f'use = "hf"\npath = "{folder}"'))
    prepared = token_cache.load_tokens(variant, root=tmp_path / "cache")
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    ids, mask = [], []
    for chat in (c for i, c in enumerate(chats) if i % 10 != 9):  # every tenth is held out
        rendered = theirs.apply_chat_template(chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        # The end-of-document token after each conversation is scored with its last (assistant) turn.
        ids += [*rendered["input_ids"], theirs.eos_token_id]
        mask += [*rendered["assistant_masks"], 1]
    assert np.asarray(prepared.train).tolist() == ids
    assert np.asarray(prepared.train_mask).tolist() == mask
    scored = prepared.tokenizer.decode(np.asarray(prepared.train)[np.asarray(prepared.train_mask) == 1])
    assert scored.startswith("1.<|im_end|>\n</s>2.<|im_end|>\n3, then more.<|im_end|>\n</s>")


def test_a_template_of_the_sources_own_serves_a_char_tokenizer(tmp_path, capsys):
    chats = conversations(10)
    write_chats(tmp_path, chats)
    path = write_manifest(tmp_path, f"template = {json.dumps(PLAIN)}", 'use = "char"')
    (variant,) = manifest.load(path)
    prepared = token_cache.load_tokens(variant, root=tmp_path / "cache")
    text = prepared.tokenizer.decode(np.asarray(prepared.train))
    assert text.startswith("system: Answer in one word.\nuser: What follows 0?\nassistant: 1.\nuser: What follows 1?")
    train, train_mask = np.asarray(prepared.train), np.asarray(prepared.train_mask)
    scored = "".join(prepared.tokenizer.decode(train[i:i + 1]) if train_mask[i] else "|" for i in range(len(train)))
    assert [s for s in scored.split("|") if s][:3] == ["1.\n", "2.\n", "3, then more.\n"]
    # A run on it chats through the same template.
    assert main(["run", path, "--out", str(tmp_path / "runs")]) == 0
    (tmp_path / "q.json").write_text(json.dumps([{"role": "user", "content": "What follows 3?"}]))
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "runs" / "default"), "--messages", str(tmp_path / "q.json"),
                 "--max-new-tokens", "4"]) == 0
    assert len(capsys.readouterr().out.strip("\n")) == 4


@pytest.mark.parametrize("case, key, words", [
    ("bad role", "data.path", "chats.jsonl:2: message 2 has role 'bot'"),
    ("template raises", "data.template", "the chat template failed: no system messages here"),
    ("no template", "data.template", "the tokenizer (char) has none"),
    ("rewrites turns", "data.template", "writes earlier turns differently"),
])
def test_bad_conversations_and_templates_are_one_line_and_exit_2(tmp_path, case, key, words):
    chats = conversations(10)
    template = {"bad role": PLAIN, "no template": None,
                "template raises": "{% if messages[0].role == 'system' %}{{ raise_exception('no system messages "
                                   "here') }}{% endif %}" + PLAIN,
                # A reasoning-model habit: only the last assistant turn keeps its thoughts.
                "rewrites turns": "{% for m in messages %}{{ m.role }}: {% if m.role == 'assistant' and not "
                                  "loop.last %}(earlier){% else %}{{ m.content }}{% endif %}\n{% endfor %}"}[case]
    write_chats(tmp_path, chats)
    if case == "bad role":
        lines = (tmp_path / "chats.jsonl").read_text().splitlines()
        lines[1] = json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]})
        (tmp_path / "chats.jsonl").write_text("\n".join(lines) + "\n")
    data = f"template = {json.dumps(template)}" if template else ""
    result = run_cli("prepare", write_manifest(tmp_path, data, 'use = "char"'),
                     env={"LMLAB_CACHE": str(tmp_path / "cache")})
    line = refused(result, key)
    assert words in line, line


def test_dask_workers_write_conversations_out_as_this_process_does(tmp_path):
    """Read in parts on a Dask cluster, the conversations go through the same template: byte-identical shards."""
    pytest.importorskip("distributed")
    from lmlab.prepare import pipeline
    from test_prepare import files_of, quiet

    text = " ".join(f"What follows {i}? {i + 1}. And then? {i + 2}, then more. Answer in one word." for i in range(40))
    folder, _ = hf_folder(tmp_path, text, chat_template=CHATML)
    for part in range(3):  # three files: three parts for the workers
        write_chats(tmp_path, conversations(10 * (part + 1))[10 * part:])
        (tmp_path / "chats.jsonl").rename(tmp_path / f"chats-{part}.jsonl")
    path = write_manifest(tmp_path, "", f'use = "hf"\npath = "{folder}"')
    (tmp_path / "chat.toml").write_text(Path(path).read_text().replace('"chats.jsonl"', '"chats-*.jsonl"'))
    (variant,) = manifest.load(path)
    local = pipeline.prepare_corpus(variant, root=tmp_path / "local", workers=1, listener=quiet)
    dask = pipeline.prepare_corpus(variant, root=tmp_path / "dask", workers=2, executor="dask", listener=quiet)
    assert files_of(dask) == files_of(local)
