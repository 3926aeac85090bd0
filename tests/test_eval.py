"""``lmlab eval``: greedy exact match on held-out instruction records."""

import gzip
import json

import torch

from lmlab import discovery
from lmlab.api import ModelShape, Record, Segment
from lmlab.evaluate import answer_all, exact_match, split_record
from lmlab.model import LanguageModel
from support import refused, run_cli


class Chars:
    """A character tokenizer over a fixed alphabet (enough for the decoding tests)."""

    eos_id = None

    def __init__(self, alphabet: str):
        self.alphabet = alphabet

    def encode(self, text):
        return [self.alphabet.index(c) for c in text]

    def decode(self, ids):
        return "".join(self.alphabet[i] for i in ids)


def greedy_without_cache(model, tokenizer, prompt: str, max_new: int, stop: str) -> str:
    ids = tokenizer.encode(prompt)
    out = []
    with torch.no_grad():
        for _ in range(max_new):
            token = model(torch.tensor([ids + out]))[0, -1].argmax().item()
            out.append(token)
            if tokenizer.decode([token]) == stop:
                break
    return tokenizer.decode(out).split(stop, 1)[0]


def test_the_prompt_is_the_leading_unscored_segments():
    record = Record((Segment("Q: ", False), Segment("two", False), Segment("A", True), Segment("B", True)))
    assert split_record(record) == ("Q: two", "AB")
    assert split_record(Record.prompt_response("p", "r")) == ("p", "r")


def test_batched_cached_answers_equal_one_by_one_greedy_decoding_without_a_cache():
    # Prompts of several lengths (batched by length) through the KV cache must give exactly what
    # token-by-token greedy decoding over the full forward pass gives, record by record.
    alphabet = "abcdefgh \n"
    torch.manual_seed(0)
    shape = ModelShape(n_layers=2, d_model=32, n_heads=4, block_size=64, vocab_size=len(alphabet))
    plugins = {slot: discovery.load(slot, name)() for slot, name in
               (("attention", "mha"), ("position", "rope"), ("ffn", "mlp"))}
    model = LanguageModel(shape, **plugins).eval()
    tokenizer = Chars(alphabet)
    prompts = ["ab", "cd", "abc", "hgf e", "a", "bb", "ddd", "e f g"]
    records = [Record.prompt_response(p, "abc") for p in prompts]
    answers = answer_all(model, tokenizer, records, stop="\n", batch_size=2)
    expected = [greedy_without_cache(model, tokenizer, p, 3 + 8, "\n") for p in prompts]
    assert [a.answer for a in answers] == expected
    assert [a.prompt for a in answers] == prompts
    # Exact match compares stripped text.
    answers[0].answer, answers[1].answer = " abc ", "abd"
    answers[0].reference = answers[1].reference = "abc"
    assert answers[0].correct and not answers[1].correct


def test_eval_scores_a_run_on_held_out_records_through_its_own_data_plugin(tmp_path):
    # A run memorises four records; eval with the run's own alpaca template answers them. Each
    # answer ends with a newline, where eval stops reading (a char tokenizer has no end token).
    records = [{"instruction": "Say it.", "input": word, "output": word.upper() + "\n"}
               for word in ("ab", "cd", "ef", "gh")]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records) * 40)
    held = tmp_path / "held.jsonl.gz"
    with gzip.open(held, "wt") as f:
        for r in records + [{"instruction": "Say it.", "input": "ab", "output": "WRONG\n"}]:
            f.write(json.dumps(r) + "\n")
    manifest = tmp_path / "m.toml"
    manifest.write_text(f"""
name = "memorise"
seed = 1
[data]
use = "alpaca"
path = "{data.name}"
prompt_template = "{{instruction}} {{input}}="
prompt_template_no_input = "{{instruction}}="
val_fraction = 0.05
[model]
n_layers = 2
d_model = 64
n_heads = 4
block_size = 32
[optimizer]
use = "adamw"
lr = 3e-3
[train]
max_steps = 150
batch_size = 16
warmup_steps = 10
eval_every = 150
checkpoint_every = 150
sample_tokens = 0
[tracker]
use = "none"
""")
    out = tmp_path / "runs"
    result = run_cli("run", str(manifest), "--out", str(out), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    answers = tmp_path / "answers.jsonl"
    result = run_cli("eval", str(out / "default"), "--data", str(held), "--out", str(answers))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in answers.read_text().splitlines()]
    assert [r["prompt"] for r in rows][:2] == ["Say it. ab=", "Say it. cd="]
    correct = sum(r["correct"] for r in rows)
    assert not rows[-1]["correct"]  # the planted wrong reference
    assert correct >= 3, rows
    assert f"({correct}/5)" in result.stdout

    # Bad input: not a run folder; a missing data file.
    assert run_cli("eval", str(tmp_path), "--data", str(held)).returncode == 2
    missing = run_cli("eval", str(out / "default"), "--data", str(tmp_path / "nope.jsonl"))
    assert missing.returncode == 2 and "nope.jsonl" in missing.stderr
    # --out naming a folder, an empty --stop (generate refuses it too): one line, nothing written.
    folder = tmp_path / "answers"
    folder.mkdir()
    refused(run_cli("eval", str(out / "default"), "--data", str(held), "--out", str(folder)), "--out")
    assert not any(folder.iterdir())
    written = tmp_path / "written.jsonl"
    refused(run_cli("eval", str(out / "default"), "--data", str(held), "--stop", "", "--out", str(written)), "--stop")
    assert not written.exists()
