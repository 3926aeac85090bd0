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


def gguf_logits(path, idx):
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    with torch.no_grad():
        return model.eval()(idx).logits


@pytest.fixture(scope="module")
def tiny_fine_tune(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("gguf")
    text = CORPUS.read_text()[:30_000]
    (tmp_path / "tiny.txt").write_text(text)
    folder, _ = hf_folder(tmp_path, text, chat_template="{% for m in messages %}{{ m.content }}{% endfor %}")
    (tmp_path / "ft.toml").write_text(FINE_TUNE.format(init=folder, data=tmp_path / "tiny.txt"))
    assert main(["run", str(tmp_path / "ft.toml"), "--out", str(tmp_path / "runs")]) == 0
    return tmp_path / "runs" / "default"


def test_a_run_exports_to_a_gguf_file_transformers_loads_with_its_logits_and_tokenizer(tiny_fine_tune, tmp_path):
    pytest.importorskip("gguf")
    ours = load_run(tiny_fine_tune)
    sample = "First Citizen:\nBefore we proceed any further, hear me speak."
    idx = torch.tensor([ours.tokenizer.encode(sample).tolist()])
    with torch.no_grad():
        mine = ours.model(idx)
    out = tmp_path / "tiny.gguf"
    assert main(["export", str(tiny_fine_tune), "--format", "gguf", "--out", str(out)]) == 0
    assert (gguf_logits(out, idx) - mine).abs().max().item() <= 1e-4
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=out.name)
    assert theirs(sample, add_special_tokens=False)["input_ids"] == idx[0].tolist()
    assert theirs.chat_template == ours.tokenizer.chat_template() and theirs.eos_token_id == ours.tokenizer.eos_id
    # 16- and 8-bit files: the matrices in those types, close to the run's logits.
    import gguf

    for dtype, kind, tolerance in (("float16", gguf.GGMLQuantizationType.F16, 2e-2),
                                   ("q8_0", gguf.GGMLQuantizationType.Q8_0, 0.1)):
        assert main(["export", str(tiny_fine_tune), "--format", "gguf", "--out", str(out), "--dtype", dtype,
                     "--overwrite"]) == 0
        types = {t.name: t.tensor_type for t in gguf.GGUFReader(out).tensors}
        assert types["blk.0.attn_q.weight"] == kind and types["blk.0.attn_norm.weight"] == gguf.GGMLQuantizationType.F32
        assert (gguf_logits(out, idx) - mine).abs().max().item() <= tolerance * mine.abs().max().item()


def test_a_qwen2_checkpoint_writes_as_gguf_with_its_logits(tiny_fine_tune, tmp_path):
    from test_hf_families import FAMILIES, random_model

    from lmlab import gguf_out, pretrained
    from lmlab_architectures.decoder import Decoder

    tokenizer = load_run(tiny_fine_tune).tokenizer
    config = FAMILIES["qwen2"]()
    config.vocab_size = tokenizer.vocab_size
    hf = random_model(config)
    hf.save_pretrained(tmp_path / "qwen2")
    tables = Decoder.hf_tables(tmp_path / "qwen2")
    model = pretrained.build(tables)
    model.load_state_dict(Decoder.hf_state(tmp_path / "qwen2"))
    tables["model"]["vocab_size"] = tokenizer.vocab_size
    out = tmp_path / "qwen2.gguf"
    gguf_out.write(out, *Decoder().hf_export(tables, model.state_dict()), tokenizer, "float32")
    idx = torch.randint(0, tokenizer.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (gguf_logits(out, idx) - hf(idx).logits).abs().max().item() <= 1e-4


def test_what_gguf_cannot_hold_is_refused(trained_run, tmp_path, capsys):
    assert main(["export", str(trained_run), "--format", "hf", "--dtype", "q8_0", "--out", str(tmp_path / "x")]) == 2
    assert "lmlab: error: --dtype: q8_0 is a GGUF type" in capsys.readouterr().err
    assert main(["export", str(trained_run), "--format", "gguf", "--out", str(tmp_path / "x.gguf")]) == 2
    assert "position.use" in capsys.readouterr().err and not (tmp_path / "x.gguf").exists()


def test_a_pythia_style_checkpoint_fine_tunes_and_exports_back_with_its_logits(tmp_path, capsys):
    """GPT-NeoX (parallel residual, a quarter of each head rotated) in through [init], out through export."""
    from test_hf_families import random_model

    text = CORPUS.read_text()[:30_000]
    (tmp_path / "tiny.txt").write_text(text)
    llama, _ = hf_folder(tmp_path, text)
    tokenizer = transformers.AutoTokenizer.from_pretrained(llama)
    neox = tmp_path / "pythia"
    random_model(transformers.GPTNeoXConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, intermediate_size=128, max_position_embeddings=64,
                                            rotary_pct=0.25)).save_pretrained(neox)
    tokenizer.save_pretrained(neox)
    (tmp_path / "ft.toml").write_text(FINE_TUNE.format(init=neox, data=tmp_path / "tiny.txt"))
    assert main(["run", str(tmp_path / "ft.toml"), "--out", str(tmp_path / "runs")]) == 0
    run_dir, out = tmp_path / "runs" / "default", tmp_path / "exported"
    assert main(["export", str(run_dir), "--format", "hf", "--out", str(out)]) == 0
    assert "as a Hugging Face gpt_neox folder" in capsys.readouterr().out
    ours = load_run(run_dir)
    assert ours.variant.uses("architecture") == "parallel-block" and ours.variant.options("position").fraction == 0.25
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    idx = torch.tensor([ours.tokenizer.encode("First Citizen:\nBefore we proceed any further").tolist()])
    with torch.no_grad():
        assert (theirs(idx).logits - ours.model(idx)).abs().max().item() <= 1e-5
