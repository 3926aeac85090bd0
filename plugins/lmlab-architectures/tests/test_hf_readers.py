"""The Hugging Face readers the architectures carry, on hand-written config.json files (no transformers):
each architecture reads its own family's model_type, filling what an older file leaves out with the
transformers config class's defaults, and refuses another family's."""

import json

import pytest

from lmlab_architectures.decoder import Decoder
from lmlab_architectures.encoder_decoder import EncoderDecoder
from lmlab_architectures.parallel_block import ParallelDecoder


def folder(tmp_path, config: dict):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_each_architecture_lists_the_model_types_it_reads():
    assert Decoder.hf_model_types == {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3",
                                      "gpt2": "GPT-2"}
    assert EncoderDecoder.hf_model_types == {"t5": "T5"}
    # Llama's and GPT-2's blocks are sequential (`decoder` reads them); GPT-NeoX's are parallel.
    assert ParallelDecoder.hf_model_types == {"gpt_neox": "GPT-NeoX"}


def test_a_short_llama_config_gets_llamaconfig_defaults(tmp_path):
    path = folder(tmp_path, {"model_type": "llama", "hidden_size": 32, "num_attention_heads": 4,
                             "num_hidden_layers": 2, "intermediate_size": 48, "vocab_size": 50})
    tables = Decoder.hf_tables(path)
    assert tables["attention"] == {"use": "gqa", "n_kv_heads": 4}  # no num_key_value_heads: one per head
    assert tables["position"] == {"use": "rope", "base": 10000.0}
    assert tables["model"]["block_size"] == 2048 and tables["model"]["tie_embeddings"] is False
    assert tables["tokenizer"] == {"use": "hf", "path": str(path)}
    assert Decoder.hf_weight_files(path) == [path / "model.safetensors"]


def test_sharded_weights_are_the_files_the_index_names_in_order(tmp_path):
    path = folder(tmp_path, {"model_type": "t5"})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00002-of-00002.safetensors", "b": "model-00001-of-00002.safetensors",
        "c": "model-00002-of-00002.safetensors"}}))
    assert EncoderDecoder.hf_weight_files(path) == [path / "model-00001-of-00002.safetensors",
                                                    path / "model-00002-of-00002.safetensors"]


def test_a_t5_config_gives_the_encoder_decoder_tables(tmp_path):
    tables = EncoderDecoder.hf_tables(folder(tmp_path, {"model_type": "t5", "num_layers": 2, "num_decoder_layers": 3,
                                                        "d_model": 32, "d_kv": 8, "num_heads": 4}))
    assert tables["architecture"] == {"use": "encoder-decoder", "encoder_layers": 2, "share_embeddings": True,
                                      "decoder_start_id": 0}  # T5Config's pad id: where its decoder starts
    assert tables["model"]["n_layers"] == 3 and tables["ffn"] == {"use": "mlp", "hidden": 2048, "activation": "relu"}


@pytest.mark.parametrize("reader, other", [(Decoder, "t5"), (EncoderDecoder, "llama")])
def test_another_familys_config_is_refused_naming_its_model_type(tmp_path, reader, other):
    with pytest.raises(ValueError, match=f"model_type '{other}'"):
        reader.hf_tables(folder(tmp_path, {"model_type": other}))
