"""Other runs an objective works with (``Objective.needs_runs``): read, checked and handed over.

A DPO run's frozen reference, a PPO run's reward model, a distillation teacher: each is a run folder
named by one of the objective's options, defaulting to the ``[init]`` run. Every such run must read
and write the same token ids as the run being trained (its tokenizer is compared id by id, as a
speculative decoder's draft is), or the log-probabilities, rewards and soft targets it gives would
be about other tokens. ``lmlab check`` reads the folders without their weights; ``lmlab run`` loads
their models, frozen, before the first batch.
"""

from functools import partial
from pathlib import Path

from lmlab.api import UserError
from lmlab.api.runs import ObjectiveContext, TrainedRun
from lmlab.generation.runs import tokenizer_mismatch


def run_paths(variant, objective) -> dict[str, Path]:
    """Option name → the run folder it names (its ``[init]`` run when unset)."""
    paths = {}
    init = init_run(variant)
    for name in objective.needs_runs:
        key = f"objective.{name}"
        value = getattr(objective.options, name, None)
        if value:
            path = Path(value)
        elif init is not None:
            path = init
        else:
            raise UserError(f"objective {objective.name!r} needs a run folder here (or an [init] run to default to)",
                            key=key)
        if not (path / "manifest.toml").is_file():
            raise UserError(f"{path} is not a run folder (no manifest.toml)", key=key)
        paths[name] = path
    return paths


def init_run(variant) -> Path | None:
    """The ``[init]`` run folder, or None (no ``[init]``, Hugging Face weights, or a trained run loaded
    back, whose ``[init]`` is not located again: its manifest.toml names every run it used)."""
    from lmlab.pretrained import RUN

    source = variant.init_source
    return Path(source.folder) if source is not None and source.kind == RUN else None


def resolved(variant, objective) -> dict[str, str]:
    """Option → run folder, for the run's manifest.toml: a run defaulted to the ``[init]`` run is named,
    so the trained run records which runs it used and loads without its ``[init]``."""
    return {name: str(path) for name, path in run_paths(variant, objective).items()}


def read_runs(variant, objective, tokenizer=None, models: bool = False) -> dict[str, TrainedRun]:
    """The objective's runs: manifest and tokenizer (and, with ``models``, the frozen model of the best
    checkpoint), each tokenizer checked against ``tokenizer`` (the run's own; None: not known yet)."""
    from lmlab import manifest
    from lmlab.assemble import assemble

    runs = {}
    for name, path in run_paths(variant, objective).items():
        key = f"objective.{name}"
        try:
            (theirs,) = manifest.load(path / "manifest.toml", [], resolve_init=False)
            built = assemble(theirs, run_dir=path, model=models)
        except UserError as exc:
            raise UserError(f"the run in {path} cannot be loaded: {exc.message}", key=key) from None
        why = None
        if tokenizer is not None:
            why = tokenizer_mismatch(tokenizer, built.tokenizer)
        elif (ours := variant.manifest.get("tokenizer")) != (theirs_table := theirs.manifest.get("tokenizer")):
            # Not fitted yet (this run learns its vocabulary from the data): other settings are enough to
            # refuse; the same settings are compared id by id when the run starts.
            why = f"tokenizer {_table(theirs_table)} vs this run's {_table(ours)}"
        if why:
            raise UserError(f"the run in {path} has a different tokenizer from this run's ({why}); its "
                            "probabilities would be about other tokens: use a run trained with the same tokenizer",
                            key=key)
        model = None
        if models:
            model = built.model.eval()
            model.requires_grad_(False)
        runs[name] = TrainedRun(path=path, manifest=theirs.manifest, tokenizer=built.tokenizer, model=model)
    objective.check_runs(runs)
    return runs


def check(variant, objective, tokenizer) -> None:
    """``lmlab check``: the objective's runs exist, load, share the tokenizer (when it is known before the
    data) and pass the objective's own ``check_runs``."""
    if not objective.needs_runs:
        return
    if tokenizer is None and init_run(variant) is not None:
        # A fine-tune's tokenizer is its [init]'s, which can be read without the data.
        from lmlab.pretrained import tokenizer_dir

        tokenizer = variant.instantiate("tokenizer")
        tokenizer.load(tokenizer_dir(variant))
    read_runs(variant, objective, tokenizer)


def prepare(variant, objective, tokenizer, decoder) -> list:
    """Before training: load the runs with their models, hand them to ``Objective.prepare`` with the
    run's generate function; returns the models, which the caller moves to the training device."""
    from lmlab.generation.batch import generate_ids

    runs = read_runs(variant, objective, tokenizer, models=True) if objective.needs_runs else {}
    generate = partial(generate_ids, decoder, eos_id=tokenizer.eos_id)
    objective.prepare(ObjectiveContext(runs=runs, tokenizer=tokenizer, generate=generate, decoder=decoder,
                                       init=init_run(variant)))
    return [run.model for run in runs.values()]


def _table(table) -> str:
    table = dict(table or {})
    use = table.pop("use", "?")
    return f"{use!r}" + (f" with {table}" if table else "")
