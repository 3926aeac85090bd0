"""A GGUF file (llama.cpp's format) as the Hugging Face folder ``[init] from`` reads.

transformers reads the file (with the ``gguf`` package), dequantising every tensor to float32, and
its tokenizer with the chat template; the result is written once as a Hugging Face folder
(config.json, model.safetensors, tokenizer files) in the cache, under the file's SHA-256, so a second
run reads safetensors only. From there the architecture plugin that reads the folder's model_type
converts it like any other: the core names no family.
"""

import hashlib
import json
import os
import shutil
from pathlib import Path

from lmlab.cache_dir import cache_root
from lmlab.errors import UserError

SUFFIX = ".gguf"


def gguf_in_folder(folder: Path) -> Path | None:
    """The one GGUF file of a folder that holds no checkpoint of another kind; None when it holds none."""
    found = sorted(folder.glob(f"*{SUFFIX}"))
    if len(found) > 1:
        raise UserError(f"{folder}: holds {len(found)} GGUF files ({', '.join(p.name for p in found[:3])}); "
                        "name one", key="init.from")
    return found[0] if found else None


def converted(path: Path) -> Path:
    """The cached Hugging Face folder of the GGUF file ``path``, written on first use (a UserError
    naming init.from for a file transformers cannot read)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    folder = cache_root() / "gguf" / digest.hexdigest()[:32]
    if (folder / "config.json").is_file():
        return folder
    model, tokenizer = _read(path)
    partial = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    _write(model, tokenizer, partial, path)
    try:
        partial.rename(folder)  # whole or absent: another process may have written it meanwhile
    except OSError:
        shutil.rmtree(partial, ignore_errors=True)
    return folder


def _read(path: Path):
    try:
        import gguf  # noqa: F401 - transformers reads GGUF with it
        import torch
        import transformers
    except ImportError as exc:
        raise UserError(f"{path}: reading GGUF needs transformers and gguf ({exc.name} is missing): "
                        "pip install 'lmlab[gguf]'", key="init.from") from None
    transformers.utils.logging.disable_progress_bar()  # one line per tensor is noise in a run's log
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                  dtype=torch.float32)
    except Exception as exc:  # noqa: BLE001 - a damaged or foreign file fails anywhere inside transformers
        first = str(exc).splitlines()[0][:300] if str(exc) else ""
        raise UserError(f"{path}: cannot be read as a GGUF checkpoint ({type(exc).__name__}: {first})",
                        key="init.from") from None
    return model, tokenizer


def _write(model, tokenizer, folder: Path, source: Path) -> None:
    """config.json, model.safetensors (a tied head is the embedding, so it is written once) and the
    tokenizer's files, as ``save_pretrained`` would; transformers refuses to save a model it loaded from
    GGUF, as a quantized one."""
    from safetensors.torch import save_file

    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["lmlab_converted_from"] = source.name
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    state = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    tokenizer.save_pretrained(folder)
