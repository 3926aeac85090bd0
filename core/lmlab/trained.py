"""A trained run, loaded back from its folder for ``lmlab generate``, ``eval``, ``merge`` and ``rerun``.

The run is assembled (:func:`lmlab.assemble.assemble`) from its own resolved manifest (its ``[init]``
is not read again: a fine-tune stands on its own once trained), with the tokenizer it was trained
with and the weights of its best checkpoint (else the last). A PEFT run's checkpoint holds only its
adapter: its base weights, the plugin applied again and the adapter are put together
(``lmlab.train.adapters``).
"""

from pathlib import Path

from lmlab.errors import UserError


def load_run(run_dir: Path, overrides: list[str] = (), *, unfinished_ok: bool = False):
    """The run in ``run_dir`` (a variant's folder), assembled with its weights: an
    :class:`lmlab.assemble.Assembly` whose model is in eval mode. A compressed run that lmlab compress
    did not finish writing is refused, except by lmlab compress itself (``unfinished_ok``), which
    loads its output back before declaring it whole."""
    from lmlab import manifest
    from lmlab.assemble import assemble
    from lmlab.compress.restore import unfinished

    manifest_path = Path(run_dir) / "manifest.toml"
    if not manifest_path.is_file():
        raise UserError("is not a run folder (no manifest.toml)", key=str(run_dir))
    why = None if unfinished_ok else unfinished(run_dir)
    if why is not None:
        raise UserError(why, key=str(run_dir))
    (variant,) = manifest.load(manifest_path, list(overrides), resolve_init=False)
    return assemble(variant, run_dir=Path(run_dir))


def refuse_bidirectional(objective) -> None:
    """Text generation continues a prompt left to right: a bidirectional (masked-LM) model cannot."""
    if not objective.causal:
        raise UserError(f"this run trained objective {objective.name!r}, a bidirectional model that predicts masked "
                        "tokens from both sides; it cannot continue a prompt left to right (train with causal-lm "
                        "or sft to generate)", key="objective.use")
