"""``lmlab export RUN_DIR --format hf|peft|gguf [--out PATH] [--dtype D]``: a trained run as a Hugging Face
folder, a PEFT run's adapter as peft saves it (:mod:`lmlab.peft_export`), or one GGUF file
(:mod:`lmlab.gguf_out`, from the Hugging Face form).

The run is loaded as ``lmlab generate`` loads it; its architecture plugin writes the family's
config.json and weights (``Architecture.hf_export``), its tokenizer plugin the tokenizer files
(``Tokenizer.save_hf``). The folder (config.json, model.safetensors, generation_config.json, the
tokenizer files and ``lmlab_export.json``: where it came from) is written beside, then renamed into
place, so an interrupted export leaves nothing half-written under the name asked for. transformers'
``AutoModelForCausalLM.from_pretrained(DIR)`` loads it; the tests check its logits are the run's.
"""

import json
import shutil
import sys
from pathlib import Path

from lmlab.errors import UserError

DTYPES = ("float32", "bfloat16", "float16", "q8_0")
#: The core tables and slots whose recorded tables say what model the run built.
MODEL_TABLES = ("model", "architecture", "position", "attention", "ffn")


def add_arguments(parser) -> None:
    parser.add_argument("run_dir", type=Path, help="a trained run's folder")
    # Checked in main against lmlab.api.architecture.EXPORT_FORMATS: the parser imports no pydantic.
    parser.add_argument("--format", required=True, metavar="FORMAT",
                        help="hf: a folder transformers loads (config.json, model.safetensors, tokenizer files); "
                             "peft: a PEFT run's adapter folder, which peft's PeftModel loads on the base; "
                             "gguf: one file llama.cpp and transformers load")
    parser.add_argument("--out", type=Path, help="the folder (the .gguf file) to write (default: RUN_DIR-FORMAT, "
                                                   "RUN_DIR.gguf, beside it)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32",
                        help="the weights' type (q8_0: 8-bit blocks, GGUF only)")
    parser.add_argument("--overwrite", action="store_true", help="replace what --out holds")


def main(args) -> int:
    from lmlab.api.architecture import EXPORT_FORMATS
    from lmlab.trained import load_run

    if args.format not in EXPORT_FORMATS:
        raise UserError(f"is {args.format!r}; lmlab export writes {', '.join(EXPORT_FORMATS)}", key="--format")
    if args.dtype == "q8_0" and args.format != "gguf":
        raise UserError("q8_0 is a GGUF type: give --format gguf, or a float dtype", key="--dtype")
    run_dir = args.run_dir
    out = args.out or run_dir.with_name(f"{run_dir.name}.gguf" if args.format == "gguf" else
                                        f"{run_dir.name}-{args.format}")
    if out.exists() and (out.is_file() or any(out.iterdir())) and not args.overwrite:
        raise UserError("exists; pass --overwrite to replace it or --out to write elsewhere", key=str(out))
    run = load_run(run_dir)
    _refuse_compressed(run, run_dir)
    if args.format == "peft":
        if run.peft is None:
            raise UserError("holds no adapter (its [peft] is none or absent): export it as hf", key=str(run_dir))
        files = _adapter(run, run_dir)
        kind = f"peft {files[0]['peft_type']} adapter"
    else:
        if run.peft is not None:
            raise UserError(f"holds a {run.variant.uses('peft')} adapter: export it as peft, or fold it into the "
                            f"base weights (lmlab merge) and export the merged run as {args.format}", key=str(run_dir))
        files = _checkpoint(run, {k: v.detach() for k, v in run.model.state_dict().items()})
        kind = f"Hugging Face {files[0]['model_type']} folder"
    if args.format == "gguf":
        from lmlab import gguf_out

        if out.is_dir():
            raise UserError("is a folder; name the .gguf file to write", key=str(out))
        gguf_out.write(out, *files, run.tokenizer, args.dtype)
        print(f"exported {run_dir} (step {run.step}) as a GGUF {files[0]['model_type']} file ({args.dtype}): {out}")
        return 0
    partial = out.with_name(f"{out.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    wrote_tokenizer = _write_adapter(run, *files, partial) if args.format == "peft" else \
        _write(run, *files, partial, args.dtype)
    if out.exists():
        shutil.rmtree(out)
    partial.rename(out)
    print(f"exported {run_dir} (step {run.step}) as a {kind}: {out}")
    if not wrote_tokenizer:
        print(f"warning: tokenizer {run.variant.uses('tokenizer')!r} has no Hugging Face form: the folder holds no "
              "tokenizer files (the model loads; encode text as the run did)", file=sys.stderr)
    return 0


def _refuse_compressed(run, run_dir: Path) -> None:
    if "compress" in run.variant.slots:
        raise UserError("is a compressed run (lmlab compress): its weights are stored in the methods' own form, "
                        "which a Hugging Face checkpoint cannot hold; export the run it was compressed from",
                        key=str(run_dir))


def _adapter(run, run_dir: Path) -> tuple[dict, dict]:
    """The adapter's config and weights under the base checkpoint's names; the base named by where the
    run's [init] came from (as its manifest records it) when that is a Hugging Face folder."""
    import tomllib

    from lmlab import peft_export

    tables = _tables(run)
    recorded = tomllib.loads((run_dir / "manifest.toml").read_text()).get("init", {}).get("from")
    folder = Path(recorded) if isinstance(recorded, str) else None
    base = str(folder.resolve()) if folder is not None and (folder / "config.json").is_file() else ""
    return peft_export.adapter_files(run, lambda state: _hf_export(run, tables, state)[1], base)


def _write_adapter(run, config: dict, state: dict, folder: Path) -> bool:
    from lmlab import peft_export

    peft_export.write(folder, config, state)
    (folder / "lmlab_export.json").write_text(json.dumps({"from": str(run.checkpoint), "step": run.step}, indent=2))
    return True


def _tables(run) -> dict:
    tables = {name: dict(run.variant.manifest[name]) for name in MODEL_TABLES}
    tables["model"]["vocab_size"] = run.shape.vocab_size
    return tables


def _checkpoint(run, state: dict) -> tuple[dict, dict]:
    return _hf_export(run, _tables(run), state)


def _hf_export(run, tables: dict, state: dict) -> tuple[dict, dict]:
    architecture = run.variant.plugins["architecture"]
    try:
        return architecture.hf_export(tables, state)
    except NotImplementedError:
        raise UserError(f"architecture {architecture.name!r} writes no Hugging Face checkpoints",
                        key="architecture.use") from None
    except ValueError as exc:
        key, _, why = str(exc).partition(": ")
        raise UserError(f"has no Hugging Face checkpoint form: {why or exc}", key=key if why else "architecture.use") \
            from None


def _write(run, config: dict, state: dict, folder: Path, dtype: str) -> bool:
    import torch
    from safetensors.torch import save_file

    cast = getattr(torch, dtype)
    save_file({k: (v.to(cast) if v.is_floating_point() else v).contiguous() for k, v in state.items()},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    tokenizer = run.tokenizer
    special = {f"{name}_token_id": tokenizer.special_id(name) for name in ("bos", "eos", "pad")
               if tokenizer.special_id(name) is not None}
    (folder / "config.json").write_text(json.dumps({**config, **special, "torch_dtype": dtype}, indent=2))
    (folder / "generation_config.json").write_text(json.dumps(special, indent=2))
    (folder / "lmlab_export.json").write_text(json.dumps({"from": str(run.checkpoint), "step": run.step,
                                                         "dtype": dtype}, indent=2))
    try:
        tokenizer.save_hf(folder)
    except NotImplementedError:
        return False
    return True
