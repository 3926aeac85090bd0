"""An lmlab encoder–decoder model configured as T5 (RMSNorm, `t5` relative buckets, `mha`, a ReLU `mlp`,
one shared embedding) and loaded with a tiny Hugging Face T5ForConditionalGeneration's weights gives the
same logits, the same loss and, mapped back through the conversion, the same gradient for every T5
parameter; a T5 folder saved by save_pretrained starts an `sft` run through ``[init] from``."""

import json

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from lmlab import manifest, pretrained  # noqa: E402
from lmlab.assemble import assemble  # noqa: E402
from lmlab.cli.main import main  # noqa: E402
from lmlab.errors import UserError  # noqa: E402
from lmlab.tables import read_toml  # noqa: E402
from lmlab_architectures import hf_t5 as t5  # noqa: E402

# 8 relative buckets reaching 20 tokens: sequences of 30 use exact, logarithmic and farthest buckets on
# both sides of the encoder's queries and in the decoder's causal ones.
SETTINGS = dict(vocab_size=100, d_model=32, d_kv=8, num_heads=4, d_ff=64, num_layers=2, num_decoder_layers=3,
                relative_attention_num_buckets=8, relative_attention_max_distance=20, dropout_rate=0.0,
                feed_forward_proj="relu", layer_norm_epsilon=1e-6, pad_token_id=0, eos_token_id=1,
                decoder_start_token_id=0)
TIES = pytest.mark.parametrize("tie", [True, False], ids=["tied-scaled", "untied-unscaled"])


def random_t5(tie: bool = True, **overrides):
    """A tiny seeded T5ForConditionalGeneration, its norm scales drawn away from one and its relative
    biases drawn large (where a mistake in applying either would not show otherwise), its embedding
    drawn small enough that float32 logits keep about six digits after the decimal point."""
    torch.manual_seed(0)
    config = transformers.T5Config(**{**SETTINGS, "tie_word_embeddings": tie, **overrides})
    model = transformers.T5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layer_norm" in name:
                p.uniform_(0.5, 1.5)
            elif "relative_attention_bias" in name:
                p.normal_(0.0, 1.0)
        model.shared.weight.mul_(0.5 if tie else 0.1)
    return model


def inputs(padded: bool):
    """Encoder ids (3, 30), decoder ids (3, 25), labels with ignored positions, and the encoder's
    attention mask (None, or rows of 30, 21 and 7 tokens, padded with the pad id)."""
    gen = torch.Generator().manual_seed(1)
    enc = torch.randint(2, 100, (3, 30), generator=gen)
    dec = torch.randint(2, 100, (3, 25), generator=gen)
    labels = torch.randint(2, 100, (3, 25), generator=gen)
    labels[2, 18:] = -100
    mask = None
    if padded:
        mask = torch.ones(3, 30, dtype=torch.long)
        mask[1, 21:] = 0
        mask[2, 7:] = 0
        enc = enc.masked_fill(mask == 0, 0)
    return enc, dec, labels, mask


def lmlab_forward(model, enc, dec, mask):
    return model(dec, encoder_ids=enc, encoder_padding=None if mask is None else ~mask.bool())


@TIES
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
def test_t5_logits_match_hugging_face(tie, padded):
    hf = random_t5(tie)
    ours = t5.from_hf(hf, pretrained.build).eval()
    enc, dec, _, mask = inputs(padded)
    with torch.no_grad():
        theirs = hf(input_ids=enc, attention_mask=mask, decoder_input_ids=dec).logits
        logits = lmlab_forward(ours, enc, dec, mask)
    assert theirs.abs().max() > 1.0  # logits of a size where the scaling of the head would show
    assert (logits - theirs).abs().max().item() <= 1e-5


@TIES
def test_t5_loss_and_every_parameter_gradient_match_hugging_face(tie):
    hf = random_t5(tie)
    ours = t5.from_hf(hf, pretrained.build).eval()
    enc, dec, labels, mask = inputs(padded=True)
    theirs = hf(input_ids=enc, attention_mask=mask, decoder_input_ids=dec, labels=labels).loss
    logits = lmlab_forward(ours, enc, dec, mask)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
    assert abs(loss.item() - theirs.item()) <= 1e-5
    theirs.backward()
    loss.backward()

    # lmlab's weight = factor × T5's (q_proj: sqrt(d_kv); head: d_model ** -0.5 where T5 scales the
    # decoder's output), so dL/d(T5's) = Σ factor × dL/d(lmlab's) over the lmlab weights made from it.
    # Sums run over parameters, not names: T5's lm_head is its shared embedding, lmlab's enc_emb its
    # tok_emb (counted once: named_parameters lists a shared parameter once).
    factors = {ours_name: (hf_name, factor) for ours_name, hf_name, factor in
               t5.weight_map(hf.config, untied_head=True)}
    expected: dict[int, torch.Tensor] = {}
    for name, p in ours.named_parameters():
        hf_name, factor = factors[name]
        target = hf.get_parameter(hf_name)
        expected[id(target)] = expected.get(id(target), 0) + factor * p.grad
    checked = 0
    for name, p in hf.named_parameters():
        assert id(p) in expected, f"no lmlab weight is made from {name}"
        assert p.grad is not None and p.grad.abs().max() > 0, name
        assert (expected[id(p)] - p.grad).abs().max().item() <= 1e-5, name
        checked += 1
    assert checked == len(expected) == 1 + 2 + 2 * 8 + 3 * 13 + 2  # shared, biases, blocks, final norms


def test_t5_manifest_tables_name_the_plugins():
    tables = t5.manifest_tables(random_t5().config)
    assert tables["model"] == {
        "n_layers": 3, "d_model": 32, "n_heads": 4, "block_size": t5.BLOCK_SIZE, "vocab_size": 100, "dropout": 0.0,
        "bias": False, "norm": "rmsnorm", "norm_eps": 1e-6, "tie_embeddings": False}
    assert tables["architecture"] == {"use": "encoder-decoder", "encoder_layers": 2, "share_embeddings": True,
                                      "decoder_start_id": 0}
    assert tables["position"] == {"use": "t5", "num_buckets": 8, "max_distance": 20}
    assert tables["attention"] == {"use": "mha"}
    assert tables["ffn"] == {"use": "mlp", "hidden": 64, "activation": "relu"}


@pytest.mark.parametrize("change, feature", [
    ({"feed_forward_proj": "gated-gelu"}, "feed_forward_proj 'gated-gelu'"),
    ({"feed_forward_proj": "gelu"}, "feed_forward_proj 'gelu'"),
    ({"d_kv": 16}, "d_kv × num_heads"),
], ids=["gated-gelu", "gelu", "d_kv"])
def test_unsupported_t5_features_are_refused(change, feature):
    config = transformers.T5Config(**{**SETTINGS, **change})
    with pytest.raises(ValueError, match=feature):
        t5.manifest_tables(config)


# -- a Hugging Face folder -------------------------------------------------------------------------

RECORDS = [{"instruction": f"Say {w} twice", "output": f"{w} {w}"} for w in
           ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve")]

FINE_TUNE = """
name = "t5-ft"

[init]
from = "{init}"

[data]
use = "alpaca"
path = "records.jsonl"
template = "compact"
val_fraction = 0.2

[architecture]
use = "encoder-decoder"

[model]
block_size = 48

[objective]
use = "sft"

[train]
max_steps = 2
batch_size = 4
eval_every = 2
eval_steps = 1
sample_tokens = 0

[tracker]
use = "none"
"""


def t5_folder(root, tie: bool = True):
    """A tiny random T5ForConditionalGeneration saved by save_pretrained, beside a T5-like tokenizer.json
    (pad 0, eos 1, unk 2; BPE over Metaspace pieces) trained here on the records' text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    text = "".join(f"Instruction: {r['instruction']}\nResponse: {r['output']}\n" for r in RECORDS)
    tok.train_from_iterator([text, "".join(map(chr, range(32, 127)))], trainers.BpeTrainer(
        vocab_size=100, special_tokens=["<pad>", "</s>", "<unk>"], show_progress=False))
    assert tok.get_vocab_size() <= 100
    folder = root / "hf-t5"
    hf = random_t5(tie)
    hf.save_pretrained(folder, safe_serialization=True)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                                         unk_token="<unk>").save_pretrained(folder)
    (root / "exp").mkdir()
    (root / "exp" / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return folder, hf


@TIES
def test_an_sft_run_starts_from_a_hugging_face_t5_folder_with_its_logits(tmp_path, tie):
    folder, hf = t5_folder(tmp_path, tie)
    path = tmp_path / "exp" / "ft.toml"
    path.write_text(FINE_TUNE.format(init="../hf-t5"))
    assert main(["check", str(path)]) == 0

    source = pretrained.locate(folder)
    assert source.kind == "Hugging Face T5" and source.weights == (folder / "model.safetensors",)
    assert pretrained.source_tables(source)["tokenizer"] == {"use": "hf", "path": str(folder)}
    (variant,) = manifest.load(path)
    assert variant.slots["architecture"].name == "encoder-decoder" and variant.model.block_size == 48
    assert variant.slots["architecture"].options.encoder_layers == 2
    model = assemble(variant).model.eval()
    record = pretrained.initialise(variant, model)
    assert record["format"] == "Hugging Face T5" and record["weights"][0]["path"] == str(folder / "model.safetensors")
    assert model.decoder_start_id == 0 and model.head.weight is not model.tok_emb.weight
    enc, dec, _, mask = inputs(padded=True)
    with torch.no_grad():
        theirs = hf(input_ids=enc, attention_mask=mask, decoder_input_ids=dec).logits
        assert (lmlab_forward(model, enc, dec, mask) - theirs).abs().max().item() <= 1e-5

    # ... and the run itself trains from it.
    assert main(["run", str(path), "--out", str(tmp_path / "runs")]) == 0
    run_dir = tmp_path / "runs" / "default"
    resolved = read_toml(run_dir / "manifest.toml")
    assert resolved["position"]["use"] == "t5" and resolved["tokenizer"]["use"] == "hf"
    assert resolved["architecture"] == {"use": "encoder-decoder", "encoder_layers": 2, "share_embeddings": True,
                                        "decoder_start_id": 0}
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["init"]["format"] == "Hugging Face T5"


def test_a_hugging_face_folder_of_another_family_is_refused_naming_its_model_type(tmp_path):
    folder, _ = t5_folder(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "bart"}))
    with pytest.raises(UserError, match="init.from: .*model_type 'bart'"):
        pretrained.locate(folder)


def test_an_unsupported_t5_folder_is_refused_naming_init_from_and_the_feature(tmp_path):
    folder, _ = t5_folder(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "feed_forward_proj": "gated-gelu"}))
    with pytest.raises(UserError, match="init.from: .*cannot be read as a T5 checkpoint: .*gated-gelu"):
        pretrained.source_tables(pretrained.locate(folder))


@TIES
def test_an_lmlab_t5_exports_to_a_checkpoint_transformers_computes_alike(tie, tmp_path):
    """hf_export inverts the reading: written out and loaded by transformers, the model computes the lmlab
    model's logits; a head trained apart from the embedding, which T5 ties, is refused naming the key."""
    from safetensors.torch import save_file

    from lmlab_architectures.encoder_decoder import EncoderDecoder

    hf = random_t5(tie)
    ours = t5.from_hf(hf, pretrained.build).eval()
    tables = t5.manifest_tables(hf.config)
    config, state = EncoderDecoder.hf_export(tables, ours.state_dict())
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"),
              metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(config))
    again = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float32).eval()
    enc, dec, _, mask = inputs(True)
    with torch.no_grad():
        assert (again(input_ids=enc, attention_mask=mask, decoder_input_ids=dec).logits
                - lmlab_forward(ours, enc, dec, mask)).abs().max().item() <= 1e-5
    trained = {**ours.state_dict(), "head.weight": ours.state_dict()["head.weight"] + 0.01}
    with pytest.raises(ValueError, match="model.tie_embeddings"):
        EncoderDecoder.hf_export(tables, trained)
