"""The `hf` tokenizer gives transformers' ids and text, adds no special tokens, and finds the special ids
a Hugging Face folder declares. The tokenizers are trained here, on a few lines (nothing is downloaded)."""

import json

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from lmlab.api import UserError
from lmlab.testing import check_plugin_class
from lmlab_hf.tokenizer import STATE_FILE, TOKENIZER_FILE, HFTokenizer

TEXT = """First Citizen:
Before we proceed any further, hear me speak.

All:
Speak, speak.   Two  spaces, a tab\there, and digits 0123456789!
Ünïcödé façade — naïve café 🙂
""" * 3
SAMPLES = [TEXT, "", " leading space", "trailing space ", "\n\n", "Speak</s>speak", "🙂🙂 x", "tab\tand\nnewline"]


def byte_level(tmp_path, with_config: bool = True):
    """A byte-level BPE (GPT-2/Llama 3 style) with a post-processor that adds <s>, as Llama's does."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([TEXT], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    folder = tmp_path / "byte-level"
    folder.mkdir()
    tok.save(str(folder / TOKENIZER_FILE))
    if with_config:
        (folder / "tokenizer_config.json").write_text(json.dumps(
            {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
             "tokenizer_class": "PreTrainedTokenizerFast"}))
    return folder


def word_level_with_unk(tmp_path):
    """A BPE over whitespace-split words with an unknown token and no byte fallback."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "</s>"], show_progress=False)
    tok.train_from_iterator(["speak hear me before we proceed any further"], trainer)
    folder = tmp_path / "with-unk"
    folder.mkdir()
    tok.save(str(folder / TOKENIZER_FILE))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 0]}))
    return folder


def fitted(path, **options):
    tok = HFTokenizer(HFTokenizer.Options(path=path, **options))
    tok.fit_documents(iter(()), path)
    return tok


def test_hf_tokenizer_conforms():
    check_plugin_class(HFTokenizer, "tokenizer", {"path": "tokenizer.json"})


def test_encode_and_decode_equal_transformers_auto_tokenizer(tmp_path):
    transformers = pytest.importorskip("transformers")
    folder = byte_level(tmp_path)
    ours = fitted(folder)
    auto = transformers.AutoTokenizer.from_pretrained(folder)
    for text in SAMPLES:
        ids = ours.encode(text).tolist()
        assert ids == auto(text, add_special_tokens=False)["input_ids"], text
        assert ours.decode(ids) == auto.decode(ids) == text  # byte-level BPE is lossless
    assert ours.eos_id == auto.eos_token_id and ours.bos_id == auto.bos_token_id
    assert ours.vocab_size == len(auto)


def test_encode_adds_no_special_tokens_though_the_post_processor_would(tmp_path):
    folder = byte_level(tmp_path)
    library = Tokenizer.from_file(str(folder / TOKENIZER_FILE))
    ours = fitted(folder)
    assert library.encode("Speak").ids[0] == ours.bos_id  # the template adds <s>...
    assert ours.encode("Speak").tolist() == library.encode("Speak", add_special_tokens=False).ids  # ...we do not
    assert ours.bos_id not in ours.encode(TEXT).tolist()


def test_special_token_text_in_a_document_is_the_token_unless_split(tmp_path):
    folder = byte_level(tmp_path)
    assert ours_ids(fitted(folder), "a</s>b").count(fitted(folder).eos_id) == 1
    split = fitted(folder, split_special_tokens=True)
    assert split.eos_id not in ours_ids(split, "a</s>b") and split.decode(split.encode("a</s>b")) == "a</s>b"


def ours_ids(tok, text):
    return tok.encode(text).tolist()


def test_save_then_load_restores_ids_and_special_tokens_without_the_original_folder(tmp_path):
    folder = byte_level(tmp_path)
    tok = fitted(folder)
    saved = tmp_path / "saved"
    saved.mkdir()
    tok.save(saved)
    assert (saved / TOKENIZER_FILE).read_bytes() == (folder / TOKENIZER_FILE).read_bytes()
    assert json.loads((saved / STATE_FILE).read_text())["special"] == {"bos": 0, "eos": 1, "pad": 2}
    for path in folder.iterdir():
        path.unlink()
    fresh = HFTokenizer(tok.options)
    fresh.load(saved)
    assert fresh.encode(TEXT).tolist() == tok.encode(TEXT).tolist() and fresh.eos_id == tok.eos_id


def test_special_tokens_written_as_added_token_objects_are_read(tmp_path):
    folder = byte_level(tmp_path)  # transformers 4 wrote {"__type": "AddedToken", "content": ...}
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"__type": "AddedToken", "content": "</s>"}}))
    assert fitted(folder).eos_id == 1


def test_eos_comes_from_generation_config_when_tokenizer_config_is_absent(tmp_path):
    tok = fitted(word_level_with_unk(tmp_path), unknown="keep")
    assert tok.eos_id == 1  # the first of the list
    assert tok.special_id("unk") == 0 and tok.special_id("mask") is None


def test_text_the_vocabulary_lacks_is_refused_naming_it(tmp_path):
    folder = word_level_with_unk(tmp_path)
    with pytest.raises(UserError, match="'§'.*tokenizer.unknown|tokenizer.unknown.*'§'"):
        fitted(folder).encode("speak § hear")
    assert 0 in fitted(folder, unknown="keep").encode("speak § hear").tolist()


def test_a_missing_tokenizer_file_is_a_user_error_naming_the_option(tmp_path):
    with pytest.raises(UserError, match="tokenizer.path"):
        fitted(tmp_path)


def test_a_tokenizer_json_file_may_be_named_directly(tmp_path):
    folder = byte_level(tmp_path)
    assert fitted(folder / TOKENIZER_FILE).encode(TEXT).tolist() == fitted(folder).encode(TEXT).tolist()


def test_the_fingerprint_changes_with_the_tokenizer_and_its_special_token_config(tmp_path):
    folder = byte_level(tmp_path)
    before = HFTokenizer(HFTokenizer.Options(path=folder)).fingerprint()
    assert HFTokenizer(HFTokenizer.Options(path=folder / TOKENIZER_FILE)).fingerprint() == before
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<pad>"}))  # the same vocabulary
    edited = HFTokenizer(HFTokenizer.Options(path=folder)).fingerprint()
    assert edited != before
    (tmp_path / "other").mkdir()
    retrained = byte_level(tmp_path / "other", with_config=False)
    (retrained / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<pad>"}))
    assert HFTokenizer(HFTokenizer.Options(path=retrained)).fingerprint() == edited  # contents, not paths
