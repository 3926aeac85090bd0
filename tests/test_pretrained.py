"""[init] from: a run starts from another run's weights and tokenizer, or from a local Hugging Face Llama
folder, and says clearly (exit 2, naming the key) when the manifest contradicts the init."""

import functools
import hashlib
import json
import shutil

import pytest
import torch
import torch.nn.functional as F

from lmlab import manifest, pretrained
from lmlab.api import hookimpl
from lmlab.checkpoint import model_state
from lmlab.tables import read_toml
from lmlab.cli.main import main
from lmlab.errors import UserError
from lmlab.assemble import assemble
from lmlab.train import runner
from lmlab_architectures import hf_llama
from lmlab.prepare import tokens as token_cache

from conftest import CORPUS, tiny_toml
from support import hf_folder, random_llama

BASE = tiny_toml("tiny.txt", name="base", sample_tokens=0)

FINE_TUNE = """
name = "ft"

[init]
from = "{init}"
checkpoint = "last"

[data]
use = "text-file"
path = "{data}"

[train]
max_steps = 2
batch_size = 4
warmup_steps = 1
eval_every = 2
eval_steps = 2
checkpoint_every = 2
log_every = 1
sample_tokens = 0

[tracker]
use = "none"
"""


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    """A 6-step char-level run; (its folder, its summary, its token data)."""
    root = tmp_path_factory.mktemp("base")
    (root / "tiny.txt").write_text(CORPUS.read_text()[:60_000])
    (root / "base.toml").write_text(BASE)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("LMLAB_CACHE", str(tmp_path_factory.getbasetemp() / "lmlab-cache"))
        (variant,) = manifest.load(root / "base.toml")
        result = runner.run_variant(variant, root / "runs" / "default")
    return root / "runs" / "default", result.summary, result.tokens


class Probe:
    """Records, once the model is built (with [init]'s weights, before any step), what a test asks."""

    def __init__(self, measure):
        self.measure, self.seen = measure, []

    @hookimpl
    def lmlab_model_built(self, model, manifest):
        was = model.training
        model.eval()
        with torch.no_grad():
            self.seen.append(self.measure(model))
        model.train(was)


def whole_split_loss(model, tokens, block_size: int) -> float:
    """The closing validation's loss: mean cross-entropy over the split's consecutive windows."""
    val = torch.from_numpy(tokens.val[:].astype("int64"))
    starts = torch.arange(0, len(val) - block_size, block_size)
    windows = val[starts[:, None] + torch.arange(block_size + 1)]  # (N, T+1)
    logits = model(windows[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1)).item()


def fine_tune(tmp_path, init, data, extra: str = ""):
    folder = tmp_path / "exp"  # the manifest lives apart from the runs: relative paths are its folder's
    folder.mkdir(exist_ok=True)
    path = folder / "ft.toml"
    path.write_text(FINE_TUNE.format(init=init, data=data) + extra)
    return path


def test_a_run_from_a_run_starts_at_its_final_validation_loss_and_resumes_from_itself(base_run, tmp_path):
    base_dir, base_summary, base_tokens = base_run
    init = tmp_path / "runs" / "base"
    shutil.copytree(base_dir, init)  # its own copy: deleted below
    shutil.copy(base_dir.parent.parent / "tiny.txt", tmp_path / "tiny.txt")
    path = fine_tune(tmp_path, "../runs/base", "../tiny.txt")
    (variant,) = manifest.load(path)
    assert variant.manifest["init"]["from"] == str(tmp_path / "exp" / ".." / "runs" / "base")
    assert variant.manifest["model"]["n_layers"] == 2 and variant.manifest["model"]["block_size"] == 16

    probe = Probe(lambda model: whole_split_loss(model, base_tokens, 16))
    run_dir = tmp_path / "runs" / "ft"
    result = runner.run_variant(variant, run_dir, extra_hooks=[probe])
    # Step 0 of the fine-tune is where the init ended: its closing whole-split validation loss.
    assert abs(probe.seen[0] - base_summary["val_loss"]) <= 1e-5, (probe.seen[0], base_summary["val_loss"])
    # The same tokens, from the init's tokenizer (not fitted again), in a cache entry of its own.
    assert (result.tokens.train[:] == base_tokens.train[:]).all()
    assert result.tokens.directory != base_tokens.directory
    summary = result.summary
    assert summary["status"] == "completed" and summary["steps"] == 2
    weights = init / "checkpoints" / "last.ckpt"
    assert summary["init"] == {"from": str(init), "format": "lmlab run", "step": 6, "weights": [
        {"path": str(weights), "sha256": hashlib.sha256(weights.read_bytes()).hexdigest()}]}
    assert json.loads((run_dir / "provenance.json").read_text())["init"] == summary["init"]

    # Resuming continues from the fine-tune's own last.ckpt: the init is not loaded again.
    probe.seen.clear()
    (resumed,) = manifest.load(path)
    again = runner.run_variant(resumed, run_dir, resume=True, extra_hooks=[probe])
    assert again.summary["val_loss"] == summary["val_loss"] and again.summary["init"] == summary["init"]
    assert abs(probe.seen[0] - base_summary["val_loss"]) > 1e-3  # fresh weights at build time

    # The fine-tuned run stands on its own: it generates with its init gone.
    shutil.rmtree(init)
    assert main(["generate", str(run_dir), "--prompt", "KING", "--max-new-tokens", "4"]) == 0


def test_a_smaller_block_size_cuts_a_learned_position_table(base_run, tmp_path):
    base_dir, _, _ = base_run
    path = fine_tune(tmp_path, base_dir, base_dir.parent.parent / "tiny.txt")
    (base,) = manifest.load(base_dir / "manifest.toml", resolve_init=False)
    (small,) = manifest.load(path, ["model.block_size=8", "model.dropout=0.1"])
    assert small.manifest["model"]["dropout"] == 0.1  # no weights depend on these two
    models = []
    for variant in (base, small):
        model = assemble(variant).model
        if variant is small:
            pretrained.initialise(variant, model)
        else:
            model.load_state_dict(model_state(base_dir / "checkpoints" / "last.ckpt")[0])
        models.append(model.eval())
    idx = torch.randint(0, 59, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(models[0](idx), models[1](idx))
    (large,) = manifest.load(path, ["model.block_size=32"])  # a learned table cannot grow
    model = assemble(large).model
    with pytest.raises(UserError, match="model.block_size: 32 is larger than the init's 16"):
        pretrained.initialise(large, model)


@pytest.mark.parametrize("override, key", [
    ("model.n_layers=3", "model.n_layers"),
    ("model.vocab_size=80", "model.vocab_size"),
    ("attention.use=gqa", "attention.use"),
    ("architecture.use=parallel-block", "architecture.use"),
    ("ffn.activation=relu", "ffn.activation"),
    ("tokenizer.use=byte", "tokenizer.use"),
    ("init.from=nothing", "init.from"),
    ("init.from=../tiny.txt", "init.from"),
])
def test_a_manifest_that_contradicts_its_init_is_refused_naming_the_key(base_run, tmp_path, capsys, override, key):
    base_dir, _, _ = base_run
    (tmp_path / "tiny.txt").write_text("x")
    path = fine_tune(tmp_path, base_dir, "../tiny.txt")
    assert main(["check", str(path), "--set", override]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"lmlab: error: {key}: ") and err.count("\n") == 1, err


@pytest.mark.parametrize("moved, architecture", [
    ({"share_embeddings": True}, {"use": "decoder"}),
    ({"architecture": "encoder-decoder", "encoder_layers": 1, "share_embeddings": False, "decoder_start_id": 0},
     {"use": "encoder-decoder", "encoder_layers": 1, "share_embeddings": False, "decoder_start_id": 0}),
], ids=["decoder", "encoder-decoder"])
def test_a_run_recorded_before_the_architecture_slot_is_read_with_one(base_run, tmp_path, capsys, moved,
                                                                        architecture):
    # Before API 1.18 a run's manifest.toml kept the family and the encoder-decoder's settings in [model]
    # (share_embeddings always, its default true): such a run still starts a fine-tune.
    from lmlab.rundir import write_toml

    base_dir, _, _ = base_run
    old = tmp_path / "old"
    shutil.copytree(base_dir, old)
    recorded = read_toml(old / "manifest.toml")
    del recorded["architecture"]
    write_toml(old / "manifest.toml", {**recorded, "model": {**recorded["model"], **moved}})
    tables = pretrained.source_tables(pretrained.locate(old, "last"))
    assert tables["architecture"] == architecture and tables["model"] == recorded["model"]
    if architecture["use"] == "decoder":
        assert main(["check", str(fine_tune(tmp_path, old, base_dir.parent.parent / "tiny.txt"))]) == 0, \
            capsys.readouterr().err


def test_an_init_run_without_checkpoints_is_refused(base_run, tmp_path, capsys):
    base_dir, _, _ = base_run
    broken = tmp_path / "broken"
    shutil.copytree(base_dir, broken, ignore=shutil.ignore_patterns("checkpoints"))
    path = fine_tune(tmp_path, broken, base_dir.parent.parent / "tiny.txt")
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lmlab: error: init.from: ") and "holds no checkpoints/last.ckpt" in err, err


def test_text_the_init_tokenizer_cannot_encode_is_refused_naming_the_data_file(base_run, tmp_path, capsys):
    base_dir, _, _ = base_run
    (tmp_path / "accents.txt").write_text("Où est la café? " * 200)
    path = fine_tune(tmp_path, base_dir, "../accents.txt")
    assert main(["run", str(path), "--out", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    assert "accents.txt" in err and "cannot encode" in err and "'ù'" in err, err


def test_a_missing_weight_is_refused_unless_not_strict():
    tables = {"model": {"n_layers": 1, "d_model": 16, "n_heads": 2, "block_size": 8, "vocab_size": 11,
                        "dropout": 0.0, "bias": False, "norm": "rmsnorm", "norm_eps": 1e-6,
                        "tie_embeddings": False},
              "position": {"use": "rope"}, "attention": {"use": "mha"}, "ffn": {"use": "swiglu"}}
    source, target = pretrained.build(tables), pretrained.build(tables)
    state = {k: v for k, v in source.state_dict().items() if k != "norm_f.weight"}
    with pytest.raises(UserError, match=r"init.strict: .*lacks 1 weight.*norm_f.weight"):
        pretrained.load_state(target, state)
    pretrained.load_state(target, state, strict=False)
    assert torch.equal(target.tok_emb.weight, source.tok_emb.weight)


# -- a Hugging Face folder -------------------------------------------------------------------------

def test_a_run_from_a_hugging_face_folder_has_its_logits_then_trains(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    text = CORPUS.read_text()[:40_000]
    (tmp_path / "tiny.txt").write_text(text)
    folder, hf = hf_folder(tmp_path, text)
    path = fine_tune(tmp_path, "../hf-llama", "../tiny.txt", "\n[model]\nblock_size = 32\n")
    sample = "First Citizen:\nBefore we proceed any further, hear me speak."
    ids = transformers.AutoTokenizer.from_pretrained(folder)(sample, add_special_tokens=False)["input_ids"]
    idx = torch.tensor([ids])
    with torch.no_grad():
        theirs = hf(idx).logits
    probe = Probe(lambda model: (model(idx) - theirs).abs().max().item())
    # `lmlab run` itself, with the probe handed to the runner it calls.
    monkeypatch.setattr(runner, "run_variant", functools.partial(runner.run_variant, extra_hooks=[probe]))
    assert main(["run", str(path), "--out", str(tmp_path / "runs")]) == 0

    assert probe.seen[0] <= 1e-5, probe.seen  # lmlab's logits are transformers' before training
    run_dir = tmp_path / "runs" / "default"
    resolved = read_toml(run_dir / "manifest.toml")
    assert resolved["attention"]["n_kv_heads"] == 2 and resolved["model"]["norm"] == "rmsnorm"
    assert resolved["tokenizer"]["use"] == "hf" and resolved["model"]["block_size"] == 32
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 2
    weights = folder / "model.safetensors"
    assert summary["init"]["format"] == "Hugging Face Llama"
    assert summary["init"]["weights"] == [{"path": str(weights),
                                           "sha256": hashlib.sha256(weights.read_bytes()).hexdigest()}]
    # The tokens trained on are the pretrained tokenizer's ids, with no special token added.
    (variant,) = manifest.load(path)
    data = token_cache.load_tokens(variant)
    auto = transformers.AutoTokenizer.from_pretrained(folder)
    cut = int(len(text) * 0.9)
    assert data.train[:].tolist() == auto(text[:cut], add_special_tokens=False)["input_ids"]
    assert data.tokenizer.eos_id == auto.eos_token_id == 1


@pytest.mark.parametrize("tie, shard", [(False, True), (True, False)], ids=["sharded", "tied"])
def test_hugging_face_weights_load_sharded_or_tied_with_equal_logits(tmp_path, tie, shard):
    folder, hf = hf_folder(tmp_path, CORPUS.read_text()[:5_000], tie=tie, shard=shard)
    assert (folder / hf_llama.SAFETENSORS_INDEX).is_file() == shard
    source = pretrained.locate(folder)
    tables = pretrained.source_tables(source)
    model = pretrained.build(tables).eval()
    pretrained.load_state(model, hf_llama.read_state(folder))
    idx = torch.randint(0, tables["model"]["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (model(idx) - hf(idx).logits).abs().max().item() <= 1e-5


@pytest.mark.parametrize("change, message", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 8.0}, "rope_parameters": None}, "rope_type 'yarn'"),
    ({"model_type": "gemma"}, "model_type 'gemma'"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_an_unsupported_hugging_face_config_is_refused_naming_init_from(tmp_path, change, message):
    folder, _ = hf_folder(tmp_path, CORPUS.read_text()[:2_000])
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(UserError, match=f"init.from: .*{message}"):
        pretrained.source_tables(pretrained.locate(folder))


def test_a_hugging_face_folder_is_read_by_the_architecture_that_lists_its_model_type(tmp_path, monkeypatch):
    """The core names no family: it asks the installed architectures, so a third party's that lists a
    model_type reads that folder, and another model_type is refused listing what they all read."""
    from lmlab import discovery
    from lmlab.api import Architecture

    folder = tmp_path / "toy"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "toy"}))
    (folder / "toy.safetensors").write_bytes(b"")
    (folder / "tokenizer.json").write_text("{}")
    tables = {"model": {"n_layers": 1, "d_model": 16, "n_heads": 2, "block_size": 8, "vocab_size": 11},
              "architecture": {"use": "decoder"}, "position": {"use": "rope"}, "attention": {"use": "mha"},
              "ffn": {"use": "swiglu"}, "tokenizer": {"use": "hf", "path": str(folder)}}

    class Toy(Architecture):
        hf_model_types = {"toy": "Toy"}

        @classmethod
        def hf_tables(cls, folder):
            return tables

        @classmethod
        def hf_weight_files(cls, folder):
            return [folder / "toy.safetensors"]

    Toy.name = "toy"
    installed, load = discovery.installed(), discovery.load
    toy = discovery.PluginInfo("architecture", "toy", "lmlab_toy:Toy", "lmlab-toy", "0.1")
    monkeypatch.setattr(discovery, "installed", lambda: {**installed, "architecture": [*installed["architecture"], toy]})
    monkeypatch.setattr(discovery, "load", lambda slot, name, key=None:
                        Toy if (slot, name) == ("architecture", "toy") else load(slot, name, key))

    source = pretrained.locate(folder)
    assert (source.kind, source.reader, source.weights) == ("Hugging Face Toy", "toy", (folder / "toy.safetensors",))
    assert pretrained.source_tables(source) == tables
    (folder / "config.json").write_text(json.dumps({"model_type": "bart"}))
    with pytest.raises(UserError, match=r"init.from: .*model_type 'bart'.*Llama \(\"llama\".*T5 \(\"t5\".*Toy \(\"toy\""):
        pretrained.locate(folder)
