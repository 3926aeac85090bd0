"""A Hugging Face checkpoint (config, state dict, tokenizer) written as one GGUF file, the format
llama.cpp, Ollama and LM Studio run, and transformers reads (``gguf_file=``).

Written with the ``gguf`` library (llama.cpp's own Python package) as llama.cpp's
``convert_hf_to_gguf.py`` writes it: the library's table names each tensor and metadata key; Llama's
query and key rows are permuted to llama.cpp's rotary layout (transformers undoes it on reading);
norms and other vectors stay float32; ``q8_0`` quantizes the matrices whose rows split into blocks of
32 and keeps the others in float16, as llama.cpp does. The tokenizer is a byte-level BPE one (what
Llama 3, SmolLM, Qwen and GPT-2 use): its vocabulary, merges, special tokens and chat template go in
as GGUF's ``tokenizer.*`` keys. llama.cpp picks its pre-tokenizer by name; the file names
``default``, the GPT-2 split, where the original tokenizer may split digits further.
"""

import json
import tempfile
from pathlib import Path

import numpy as np
import torch

from lmlab.errors import UserError

#: Hugging Face model_type → the GGUF architecture llama.cpp writes it as.
ARCHITECTURES = {"llama": "LLAMA", "mistral": "LLAMA", "qwen2": "QWEN2", "qwen3": "QWEN3"}
#: --dtype → the GGML type of the matrices.
TYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "q8_0": "Q8_0"}
#: ... and the file type GGUF records for it (llama.cpp's LlamaFileType).
FILE_TYPES = {"F32": "ALL_F32", "F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16", "Q8_0": "MOSTLY_Q8_0"}


def write(path: Path, config: dict, state: dict[str, torch.Tensor], tokenizer, dtype: str) -> None:
    """``path`` written (atomically) as a GGUF file of the checkpoint and the run's ``tokenizer``."""
    try:
        import gguf
    except ImportError:
        raise UserError("writing GGUF needs the gguf package: pip install 'lmlab[gguf]'", key="--format") from None

    kind = config["model_type"]
    if kind not in ARCHITECTURES:
        raise UserError(f"the model is a Hugging Face {kind} checkpoint, which lmlab does not write as GGUF "
                        f"(it writes {', '.join(sorted(ARCHITECTURES))}); export it as hf", key="--format")
    if config.get("rope_scaling"):
        raise UserError("rope scaling is not written to GGUF here (llama.cpp keeps it as a frequency tensor); "
                        "export it as hf", key="position.scaling")
    arch = getattr(gguf.MODEL_ARCH, ARCHITECTURES[kind])
    matrix_type = getattr(gguf.GGMLQuantizationType, TYPES[dtype])
    partial = path.with_name(path.name + ".partial")
    writer = gguf.GGUFWriter(partial, gguf.MODEL_ARCH_NAMES[arch])
    try:
        _hyperparameters(writer, config, getattr(gguf.LlamaFileType, FILE_TYPES[TYPES[dtype]]))
        _tokenizer(writer, tokenizer, config["vocab_size"])
        names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
        heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        for name, tensor in state.items():
            theirs = names.get_name(name, try_suffixes=(".weight", ".bias"))
            if theirs is None:
                raise UserError(f"the checkpoint's tensor {name} has no GGUF name for {kind}", key="--format")
            array = tensor.detach().float().numpy()
            if arch == gguf.MODEL_ARCH.LLAMA and name.endswith(("q_proj.weight", "k_proj.weight")):
                array = _rotary_rows(array, heads if name.endswith("q_proj.weight") else kv_heads)
            _add(writer, gguf, theirs, array, matrix_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        partial.replace(path)
    except BaseException:
        writer.close()
        partial.unlink(missing_ok=True)
        raise


def _hyperparameters(writer, config: dict, file_type) -> None:
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(float(config["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_rope_dimension_count(head_dim)
    if head_dim * config["num_attention_heads"] != config["hidden_size"]:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(file_type)


def _rotary_rows(array: np.ndarray, heads: int) -> np.ndarray:
    """Hugging Face's rotary layout (each head's halves) → llama.cpp's (interleaved pairs)."""
    return array.reshape(heads, 2, array.shape[0] // heads // 2, *array.shape[1:]).swapaxes(1, 2).reshape(array.shape)


def _add(writer, gguf, name: str, array: np.ndarray, matrix_type) -> None:
    kind = gguf.GGMLQuantizationType
    wanted = matrix_type if array.ndim == 2 else kind.F32
    if wanted == kind.Q8_0 and array.shape[-1] % gguf.GGML_QUANT_SIZES[kind.Q8_0][0]:
        wanted = kind.F16
    if wanted == kind.F32:
        writer.add_tensor(name, array.astype(np.float32))
    elif wanted == kind.F16:
        writer.add_tensor(name, array.astype(np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(array, wanted), raw_dtype=wanted)


def _tokenizer(writer, tokenizer, vocab_size: int) -> None:
    import gguf

    with tempfile.TemporaryDirectory(prefix="lmlab-gguf-") as tmp:
        try:
            tokenizer.save_hf(Path(tmp))
        except NotImplementedError:
            raise UserError(f"tokenizer {tokenizer.name!r} has no Hugging Face form, which the GGUF file's "
                            "tokenizer is written from", key="tokenizer.use") from None
        spec = json.loads((Path(tmp) / "tokenizer.json").read_text(encoding="utf-8"))
    model = spec.get("model", {})
    if model.get("type") != "BPE" or not any(p.get("type") == "ByteLevel" for p in _pre_tokenizers(spec)):
        raise UserError("GGUF's tokenizer is written here from byte-level BPE tokenizers (Llama 3, SmolLM, Qwen, "
                        "GPT-2); this one is not", key="tokenizer.use")
    pieces = {int(i): token for token, i in model["vocab"].items()}
    added = {int(t["id"]): t for t in spec.get("added_tokens", [])}
    pieces.update({i: t["content"] for i, t in added.items()})
    size = max(vocab_size, max(pieces) + 1)
    tokens, types = [], []
    for i in range(size):
        if i not in pieces:  # rows of a padded embedding: no piece of the tokenizer's
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        tokens.append(pieces[i])
        types.append(gguf.TokenType.CONTROL if added.get(i, {}).get("special") else
                     gguf.TokenType.USER_DEFINED if i in added else gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])])
    for name, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                      ("unk", writer.add_unk_token_id), ("pad", writer.add_pad_token_id)):
        if tokenizer.special_id(name) is not None:
            add(int(tokenizer.special_id(name)))
    writer.add_add_bos_token(False)  # lmlab encodes text without one, as the run was trained
    if tokenizer.chat_template() is not None:
        writer.add_chat_template(tokenizer.chat_template())


def _pre_tokenizers(spec: dict) -> list[dict]:
    pre = spec.get("pre_tokenizer") or {}
    return pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
