"""``lmlab export --format hf``: a run fine-tuned from a Hugging Face folder comes back out as one that
transformers loads, with the run's logits, its tokenizer's ids and its greedy continuation; runs that
no Hugging Face family can hold are refused naming why. ``--format peft``: a LoRA, DoRA or IA3 run's
adapter loads with peft's ``PeftModel`` on the base folder with the run's logits."""

import json

import pytest
import torch

from lmlab.cli.main import main
from lmlab.trained import load_run
from conftest import CORPUS
from support import hf_folder

transformers = pytest.importorskip("transformers")

FINE_TUNE = """
name = "ft"
[init]
from = "{init}"
[data]
use = "text-file"
path = "{data}"
[model]
block_size = 32
[tracker]
use = "none"
[train]
sample_tokens = 0
max_steps = 2
eval_every = 2
batch_size = 4
eval_steps = 1
warmup_steps = 1
"""


def test_a_fine_tuned_run_exports_to_a_folder_transformers_loads_with_its_logits(tmp_path, capsys):
    text = CORPUS.read_text()[:30_000]
    (tmp_path / "tiny.txt").write_text(text)
    folder, _ = hf_folder(tmp_path, text, tie=True)
    (tmp_path / "ft.toml").write_text(FINE_TUNE.format(init=folder, data=tmp_path / "tiny.txt"))
    assert main(["run", str(tmp_path / "ft.toml"), "--out", str(tmp_path / "runs")]) == 0
    run_dir, out = tmp_path / "runs" / "default", tmp_path / "exported"
    assert main(["export", str(run_dir), "--format", "hf", "--out", str(out)]) == 0
    assert "as a Hugging Face llama folder" in capsys.readouterr().out
    assert not (tmp_path / "exported.partial").exists()

    ours = load_run(run_dir)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    sample = "First Citizen:\nBefore we proceed any further, hear me speak."
    ids = tokenizer(sample, add_special_tokens=False)["input_ids"]
    assert ids == ours.tokenizer.encode(sample).tolist()
    idx = torch.tensor([ids])
    with torch.no_grad():
        assert (theirs(idx).logits - ours.model(idx)).abs().max().item() <= 1e-5
    greedy = theirs.generate(idx, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    with torch.no_grad():
        mine = idx
        for _ in range(8):
            mine = torch.cat([mine, ours.model(mine)[:, -1:].argmax(-1)], dim=1)
    assert greedy.tolist() == mine.tolist()
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["eos_token_id"] == ours.tokenizer.eos_id

    # bfloat16 on request; an existing folder is kept unless --overwrite.
    assert main(["export", str(run_dir), "--format", "hf", "--out", str(out)]) == 2
    assert main(["export", str(run_dir), "--format", "hf", "--out", str(out), "--dtype", "bfloat16",
                 "--overwrite"]) == 0
    assert transformers.AutoModelForCausalLM.from_pretrained(out).dtype == torch.bfloat16


def test_a_run_no_family_holds_is_refused_naming_the_plugin(trained_run, tmp_path, capsys):
    # The tiny runs' model: learned positions (no Llama), no biases (no GPT-2).
    assert main(["export", str(trained_run), "--format", "hf", "--out", str(tmp_path / "x")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("lmlab: error: position.use: has no Hugging Face checkpoint form: 'learned' (the Llama "
                           "family has rope); model.bias: False (GPT-2 has True)"), line
    assert not (tmp_path / "x").exists() and not (tmp_path / "x.partial").exists()


LORA = """
[peft]
use = "{method}"
targets = {targets}
[optimizer]
use = "adamw"
lr = 0.05
"""


@pytest.mark.parametrize("method, targets", [("lora", '["q", "k", "v", "o", "up", "down", "gate"]'),
                                             ("dora", '["q", "v"]'), ("ia3", '["k", "v", "down"]')])
def test_a_peft_run_exports_an_adapter_peft_loads_on_the_base_with_the_runs_logits(tmp_path, capsys, method, targets):
    peft = pytest.importorskip("peft")
    text = CORPUS.read_text()[:30_000]
    (tmp_path / "tiny.txt").write_text(text)
    folder, _ = hf_folder(tmp_path, text)
    (tmp_path / "ft.toml").write_text(FINE_TUNE.format(init=folder, data=tmp_path / "tiny.txt")
                                      + LORA.format(method=method, targets=targets))
    assert main(["run", str(tmp_path / "ft.toml"), "--out", str(tmp_path / "runs")]) == 0
    run_dir, out = tmp_path / "runs" / "default", tmp_path / "adapter"
    assert main(["export", str(run_dir), "--format", "peft", "--out", str(out)]) == 0
    assert "adapter" in capsys.readouterr().out
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(folder.resolve()) and config["task_type"] == "CAUSAL_LM"

    ours = load_run(run_dir)
    base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    theirs = peft.PeftModel.from_pretrained(base, out).eval()
    idx = torch.tensor([ours.tokenizer.encode("First Citizen:\nBefore we proceed any further").tolist()])
    with torch.no_grad():
        mine = ours.model(idx)
        assert (theirs(idx).logits - mine).abs().max().item() <= 1e-5
        with theirs.disable_adapter():  # the adapter is what makes the difference
            assert (theirs(idx).logits - mine).abs().max().item() > 1e-3
    # A run without an adapter is refused as peft; a PEFT run as hf.
    assert main(["export", str(run_dir), "--format", "hf", "--out", str(tmp_path / "x")]) == 2
    assert "export it as peft" in capsys.readouterr().err


def test_an_adapter_peft_cannot_load_is_refused_naming_the_plugin(tmp_path, capsys):
    text = CORPUS.read_text()[:30_000]
    (tmp_path / "tiny.txt").write_text(text)
    folder, _ = hf_folder(tmp_path, text)
    (tmp_path / "ft.toml").write_text(FINE_TUNE.format(init=folder, data=tmp_path / "tiny.txt")
                                      + '[peft]\nuse = "adapter"\n')
    assert main(["run", str(tmp_path / "ft.toml"), "--out", str(tmp_path / "runs")]) == 0
    capsys.readouterr()
    assert main(["export", str(tmp_path / "runs" / "default"), "--format", "peft", "--out", str(tmp_path / "a")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("lmlab: error: peft.use: peft plugin 'adapter' makes an adapter Hugging Face's peft") and \
        not (tmp_path / "a").exists()
