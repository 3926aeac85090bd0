"""A trained run, loaded back from its folder for ``lmlab generate``, ``eval`` and ``merge``.

The model is rebuilt from the run's own resolved manifest (its ``[init]`` is not read again: a
fine-tune stands on its own once trained), with the tokenizer it was trained with and the weights
of its best checkpoint (else the last). A PEFT run's checkpoint holds only its adapter: its base
weights, the plugin applied again and the adapter are put together (``lmlab.train.adapters``).
"""

from dataclasses import dataclass
from pathlib import Path

from lmlab.errors import UserError


@dataclass
class TrainedRun:
    variant: object
    model: object  # lmlab.model.LanguageModel, in eval mode
    tokenizer: object
    plugins: dict  # slot → plugin instance, for the slots asked for
    peft: object | None  # the applied peft plugin, or None
    step: int
    shape: object
    checkpoint: Path  # the file the weights came from (best.ckpt, else last.ckpt)


def load_run(run_dir: Path, overrides: list[str] = (), slots: tuple[str, ...] = ()) -> TrainedRun:
    """The run in ``run_dir`` (a variant's folder). ``slots``: plugins to instantiate besides the
    model's own (position, attention, ffn), e.g. ``("decoding",)``."""
    from lmlab import manifest
    from lmlab.checkpoint import best_or_last
    from lmlab.train import adapters, build

    manifest_path = Path(run_dir) / "manifest.toml"
    if not manifest_path.is_file():
        raise UserError("is not a run folder (no manifest.toml)", key=str(run_dir))
    (variant,) = manifest.load(manifest_path, list(overrides), resolve_init=False)
    tokenizer = load_tokenizer(variant, Path(run_dir))
    plugins = {slot: variant.instantiate(slot) for slot in ("position", "attention", "ffn", *slots)}
    shape = build.model_shape(variant, tokenizer.vocab_size)
    model = build.build_model(variant, shape, plugins)
    checkpoint = best_or_last(Path(run_dir))
    step, peft = adapters.load_run_weights(model, variant, Path(run_dir), checkpoint)
    model.eval()
    return TrainedRun(variant, model, tokenizer, plugins, peft, step, shape, checkpoint)


def load_tokenizer(variant, run_dir: Path):
    """The fitted tokenizer a run saved in ``tokenizer/`` when it started; a UserError naming the folder
    when it is missing or cannot be read."""
    folder = run_dir / "tokenizer"
    if not folder.is_dir():
        raise UserError("is missing: a run writes its fitted tokenizer there when it starts (was the folder "
                        "copied without it?)", key=str(folder))
    tokenizer = variant.instantiate("tokenizer")
    try:
        tokenizer.load(folder)
    except UserError:
        raise
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"cannot be read by the {variant.manifest['tokenizer']['use']} tokenizer "
                        f"({type(exc).__name__}: {exc})", key=str(folder)) from None
    return tokenizer


def refuse_bidirectional(variant) -> None:
    """Text generation continues a prompt left to right: a bidirectional (masked-LM) model cannot."""
    objective = variant.instantiate("objective")
    if not objective.causal:
        raise UserError(f"this run trained objective {objective.name!r}, a bidirectional model that predicts masked "
                        "tokens from both sides; it cannot continue a prompt left to right (train with causal-lm "
                        "or sft to generate)", key="objective.use")
