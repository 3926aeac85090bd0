"""Loading a compressed run: the model is built from the manifest as usual, then each method recorded in
the checkpoint restructures it (the same module types and shapes it left), so the state dict loads
strictly. The records name registered plugins only: nothing is imported by path."""

from pathlib import Path

from lmlab.errors import UserError

#: The checkpoint entry holding one record per method, in the order they ran:
#: ``{"plugin": name, "options": {...}, "record": {...}}``.
KEY = "lmlab_compress"


def restructure(model, records: list[dict], where: Path | str) -> None:
    """Give ``model`` (just built, nothing loaded) the structure the recorded methods left."""
    from lmlab import discovery
    from lmlab.tables import validate_options

    check_loadable(records, where)
    for entry in records:
        name = entry["plugin"]
        cls = discovery.load("compress", name, key=str(where))
        options = validate_options(cls.Options, entry.get("options") or {}, f"compress.{name}", Path(where).parent)
        cls(options).restructure(model, entry.get("record") or {})
    model.lmlab_compress = list(records)  # a fine-tune from this model writes them into its own checkpoints


def records_of(model) -> list[dict] | None:
    """The compress records a model was built with (None: an ordinary model)."""
    return getattr(model, "lmlab_compress", None) or None


def check_loadable(records, where: Path | str) -> None:
    """A UserError naming the checkpoint when its entry is not a list of method records."""
    if not isinstance(records, list) or not all(isinstance(r, dict) and "plugin" in r for r in records):
        raise UserError(f"its {KEY} entry is not a list of method records", key=str(where))


#: The suffix of the folder lmlab compress writes before renaming it to the name asked for.
PARTIAL = ".partial"


def unfinished(run_dir: Path | str) -> str | None:
    """Why ``run_dir`` must not be loaded: a folder lmlab compress was still writing when it was stopped
    (killed, out of disk), its weights possibly half there. A compressed run is whole once its
    summary.json says ``completed`` (written last, then the folder renamed from ``.partial``).
    None for any other folder, ordinary runs (loadable mid-training) included."""
    import json

    from lmlab.tables import read_toml

    run_dir = Path(run_dir)
    try:
        manifest = read_toml(run_dir / "manifest.toml")
    except UserError:
        return None  # not a run folder: the loader says so itself
    if "compress" not in manifest:
        return None
    if run_dir.name.endswith(PARTIAL):
        return (f"is the half-written output of an interrupted lmlab compress ({PARTIAL}); run the same lmlab "
                "compress again, which replaces it")
    try:
        status = json.loads((run_dir / "summary.json").read_text()).get("status")
    except (OSError, ValueError, AttributeError):
        status = None
    if status != "completed":
        return ("is a compressed run that lmlab compress did not finish writing (no completed summary.json); "
                "run lmlab compress again")
    return None
