"""hf passes lmlab's conformance kit for the tokenizer slot, on a byte-level BPE trained here on the kit's
corpus (nothing is downloaded), with and without a pad token in tokenizer_config.json."""

import json

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from lmlab.testing import check_tokenizer
from lmlab.testing.tokenizer import CORPUS
from lmlab_hf.tokenizer import TOKENIZER_FILE, HFTokenizer


def byte_level_folder(folder, config: dict):
    """A GPT-2 style byte-level BPE trained on the kit's corpus, with ``config`` as tokenizer_config.json."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(list(CORPUS), trainer)
    folder.mkdir()
    tok.save(str(folder / TOKENIZER_FILE))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_conformance_with_bos_and_eos(tmp_path):
    folder = byte_level_folder(tmp_path / "tok", {"bos_token": "<s>", "eos_token": "</s>"})
    check_tokenizer(HFTokenizer, {"path": str(folder)})
    check_tokenizer(HFTokenizer, {"path": str(folder / TOKENIZER_FILE), "split_special_tokens": True})


def test_conformance_with_a_pad_token(tmp_path):
    folder = byte_level_folder(tmp_path / "tok", {"eos_token": "</s>", "pad_token": "<pad>"})
    check_tokenizer(HFTokenizer, {"path": str(folder)})
