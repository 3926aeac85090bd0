"""Starting a run from trained weights: ``[init] from = "<run folder | checkpoint | Hugging Face folder>"``.

Fine-tuning continues a model instead of starting one (Howard & Ruder 2018, "Universal Language Model
Fine-tuning"; Radford et al. 2018): the run takes the init's weights, its shape and its tokenizer, and
trains them further on its own data with a fresh optimizer. An init is one of

- an lmlab run folder (it holds ``manifest.toml``): its resolved ``[model]``, ``[architecture]``,
  ``[position]``, ``[attention]``, ``[ffn]`` and ``[tokenizer]`` tables (a run recorded before API
  1.18 has its ``[model]`` family keys read as its ``[architecture]``), its fitted tokenizer
  (``tokenizer/``) and the weights of ``checkpoints/best.ckpt`` (``init.checkpoint = "best"``;
  last.ckpt when there is no best) or ``last.ckpt``;
- a checkpoint file in a run folder (``.../checkpoints/last.ckpt``): the same, with that file's weights;
- a local Hugging Face folder (``config.json``, ``model.safetensors`` or a sharded
  ``model.safetensors.index.json``, ``tokenizer.json``), as ``save_pretrained`` writes it, of a family
  an installed architecture plugin reads: the one whose ``hf_model_types`` lists config.json's
  ``model_type`` gives the tables (``hf_tables``), the weight files (``hf_weight_files``) and the
  weights in lmlab's names (``hf_state``); any other model_type is refused. The first-party readers:
  Llama (the ``decoder`` architecture) and T5 (``encoder-decoder``), in lmlab-architectures.

Three moments of a run use it. **Validation** (:func:`merge_tables`, so ``lmlab check`` shows it): the
init's tables replace the manifest's; a value the manifest sets itself must agree with the init's, or
it is refused naming the key, except where no weight depends on it: ``model.dropout``,
``model.init_std`` (what ``strict = false`` initialises), ``model.block_size`` (the training window; a
learned position table is cut to a smaller one) and the tokenizer's options (the vocabulary is the
init's fitted one; options only change how text is encoded, e.g. the char tokenizer's ``unknown``).
**Preparing tokens**: the tokenizer is the init's, loaded and never fitted again (fitting would assign
other ids), and the token cache's key holds a digest of it (:func:`tokenizer_digest`). **Building the
model** (:func:`initialise`, called by the runner right after the model is built, before anything
wraps, adapts or shards it): the weights are loaded, checked name by name and shape by shape, and
their source (path and SHA-256) is recorded in provenance.json and summary.json. A fine-tune that is
resumed continues from its own last.ckpt: the init is not read again.

Nothing here imports Lightning; reading the tables needs no weights, so validation stays light.
"""

import hashlib
import json
import tempfile
from pathlib import Path

from lmlab import gguf_in
from lmlab.gguf_in import SUFFIX as GGUF_SUFFIX
from lmlab.hf_folder import HUGGING_FACE, load_reader, reader_for
from lmlab.upgrade import upgrade_recorded
from lmlab.checkpoint import problem as checkpoint_problem
from lmlab.errors import UserError
from lmlab.tables import read_toml, validate_options
from lmlab.variant import InitSource

#: The tables an init decides.
GOVERNED = ("model", "architecture", "position", "attention", "ffn", "tokenizer")
#: [model] keys a fine-tune may set to another value than the init's: no weight depends on them.
FREE_MODEL_KEYS = frozenset({"dropout", "block_size", "init_std"})
RUN = "lmlab run"


def locate(path: Path, checkpoint: str = "best") -> InitSource:
    """What ``init.from`` names, checked for the files a run needs (a UserError naming init.from)."""
    path = Path(path).resolve()  # "exp/../runs/x" reads better as "runs/x", in messages and records

    def refuse(message: str):
        return UserError(f"{path}: {message}", key="init.from")

    if path.is_file() and path.suffix == GGUF_SUFFIX:
        return _hugging_face(path, gguf_in.converted(path), refuse)
    if path.is_file():
        run = path.parent.parent
        if path.suffix != ".ckpt" or path.parent.name != "checkpoints" or not (run / "manifest.toml").is_file():
            raise refuse("is a file, but not a checkpoint of a run folder (<run>/checkpoints/<name>.ckpt)")
        _check_finished(run, refuse)
        _check_readable(path, refuse)
        return InitSource(path, RUN, run, (path,), _run_tokenizer(run, refuse))
    if not path.is_dir():
        raise refuse("no such run folder, checkpoint or Hugging Face folder")
    if (path / "manifest.toml").is_file():
        _check_finished(path, refuse)
        found = [path / "checkpoints" / name for name in
                 (("best.ckpt", "last.ckpt") if checkpoint == "best" else ("last.ckpt",))]
        found = [p for p in found if p.is_file()]
        if len(found) > 1 and checkpoint_problem(found[0], deep=False):  # a damaged best: the last, as a run would
            found = found[1:]
        if not found:
            raise refuse(f"the run holds no checkpoints/{checkpoint}.ckpt"
                         f"{' or last.ckpt' if checkpoint == 'best' else ''} (it never reached one)")
        _check_readable(found[0], refuse)
        return InitSource(path, RUN, path, (found[0],), _run_tokenizer(path, refuse))
    if (path / "config.json").is_file():
        return _hugging_face(path, path, refuse)
    gguf = gguf_in.gguf_in_folder(path)
    if gguf is not None:
        return _hugging_face(gguf, gguf_in.converted(gguf), refuse)
    runs = sorted(p.name for p in path.iterdir() if (p / "manifest.toml").is_file())
    if runs:
        raise refuse(f"holds the runs of a sweep; name one of them ({', '.join(runs[:3])}"
                     f"{', ...' if len(runs) > 3 else ''})")
    raise refuse("is neither a run folder (manifest.toml), a Hugging Face folder (config.json) nor a GGUF file")


def _hugging_face(path: Path, folder: Path, refuse) -> InitSource:
    """``path`` read as the Hugging Face folder ``folder`` (itself, or a GGUF file's conversion)."""
    name, reader, family = reader_for(folder, refuse)
    weights = reader.hf_weight_files(folder)
    missing = [p.name for p in weights if not p.is_file()]
    if missing:
        other = " (only safetensors are read: pickled .bin weights can run code; convert with "\
                "save_pretrained(..., safe_serialization=True))" if list(folder.glob("*.bin")) else ""
        raise refuse(f"a Hugging Face folder without {', '.join(missing)}{other}")
    if not (folder / "tokenizer.json").is_file():
        raise refuse("a Hugging Face folder without tokenizer.json (the `hf` tokenizer reads the fast-tokenizer "
                     "file; AutoTokenizer.from_pretrained(...).save_pretrained(folder) writes one)")
    return InitSource(path, HUGGING_FACE.format(family=family), folder, tuple(weights), folder, name)


def _check_finished(run: Path, refuse) -> None:
    """A half-written lmlab compress output is no init: its weights may be cut short."""
    from lmlab.compress.restore import unfinished

    why = unfinished(run)
    if why is not None:
        raise refuse(why)


def _check_readable(checkpoint: Path, refuse) -> None:
    """A cheap look (the archive's directory, not every checksum: this runs in ``lmlab check``)."""
    why = checkpoint_problem(checkpoint, deep=False)
    if why is not None:
        raise refuse(f"{checkpoint.name} is unreadable: {why}")


def _run_tokenizer(run: Path, refuse) -> Path:
    if not (run / "tokenizer").is_dir():
        raise refuse("the run folder holds no tokenizer/ (a run writes it when it starts training)")
    return run / "tokenizer"


def source_tables(source: InitSource) -> dict[str, dict]:
    """The init's [model], [architecture], [position], [attention], [ffn] and [tokenizer] tables."""
    if source.kind == RUN:
        recorded = upgrade_recorded(read_toml(source.folder / "manifest.toml"))
        absent = [t for t in GOVERNED if not isinstance(recorded.get(t), dict)]
        if absent:
            raise UserError(f"{source.folder}: its manifest.toml has no [{absent[0]}] table; is it a run folder?",
                            key="init.from")
        return {t: recorded[t] for t in GOVERNED}
    family = source.kind.removeprefix(HUGGING_FACE.format(family=""))
    try:
        tables = load_reader(source.reader).hf_tables(source.folder)
    except (ValueError, KeyError, TypeError, json.JSONDecodeError) as exc:
        raise UserError(f"{source.folder}: cannot be read as a {family} checkpoint: {type(exc).__name__}: {exc}",
                        key="init.from") from None
    absent = [t for t in GOVERNED if not isinstance(tables.get(t), dict)]
    if absent:  # a third party's reader: merge_tables needs every one
        raise UserError(f"{source.folder}: architecture {source.reader!r} read no [{absent[0]}] table from it",
                        key="init.from")
    return tables


def build(tables: dict):
    """An (untrained) model of an init's tables (:func:`source_tables`, an architecture's
    ``hf_tables``), with no objective, built as every run's model is (:func:`lmlab.model.build_model`):
    what a checkpoint converted in memory is loaded into (``from_hf(hf_model, build)`` of the
    first-party readers). Tables without [architecture] (recorded before API 1.18) get the default."""
    from lmlab import discovery
    from lmlab.config import ModelOptions
    from lmlab.model import build_model, shape_of

    model = ModelOptions(**tables["model"])
    plugins = {}
    for slot in ("architecture", "position", "attention", "ffn"):
        if slot in tables or slot != "architecture":
            cls = discovery.load(slot, tables[slot]["use"])
            plugins[slot] = cls(cls.Options(**{k: v for k, v in tables[slot].items() if k != "use"}))
    arch = plugins.get("architecture")
    return build_model(model, shape_of(model, model.vocab_size), plugins,
                       arch.decoder_start_id(None) if arch is not None else None)


# -- validation -------------------------------------------------------------------------------------

def merge_tables(manifest: dict, source: InitSource, explicit: list[str] | None, base_dir: Path) -> dict:
    """``manifest`` with the init's tables in place of its own; a UserError naming the key for a value
    the manifest sets (``explicit``: the dotted keys the user gave; None: every key present) that the
    init contradicts. ``source`` is where [init] from was found (:func:`locate`)."""
    tables = source_tables(source)
    out = dict(manifest)
    for table in GOVERNED:
        mine = manifest.get(table, {})
        if not isinstance(mine, dict):
            continue  # validation says it must be a table
        keys = _user_keys(table, mine, explicit)
        _check_agreement(table, tables[table], {k: mine[k] for k in keys}, source, base_dir)
        out[table] = {**tables[table], **{k: mine[k] for k in keys}}
    return out


def _user_keys(table: str, values: dict, explicit: list[str] | None) -> list[str]:
    if explicit is None or table in explicit:  # unknown, or the whole table given (a sweep axis of tables)
        return list(values)
    return [k for k in values if f"{table}.{k}" in explicit or any(e.startswith(f"{table}.{k}.") for e in explicit)]


def _check_agreement(table: str, theirs: dict, mine: dict, source: InitSource, base_dir: Path) -> None:
    from lmlab import discovery
    from lmlab.config import CORE_TABLES

    def refuse(key: str, was, now, what: str):
        was, now = ("unset" if v is None else repr(v) for v in (was, now))
        raise UserError(f"is {now} here, but {was} in the init ({source.path}); a run that starts from "
                        f"[init] keeps the init's {what}: leave {table}.{key} out, or start from another init",
                        key=f"{table}.{key}")

    if table == "tokenizer":
        if "use" in mine and mine["use"] != theirs.get("use"):
            refuse("use", theirs.get("use"), mine["use"], "fitted tokenizer (its token ids are the model's)")
        return
    if table == "model":
        options_cls, plugin = CORE_TABLES["model"], None
        checked = [k for k in mine if k not in FREE_MODEL_KEYS]
    else:
        if "use" in mine and mine["use"] != theirs.get("use"):
            refuse("use", theirs.get("use"), mine["use"], f"{table} plugin")
        cls = discovery.load(table, theirs["use"], key=f"{table}.use")
        options_cls, plugin = cls.Options, theirs["use"]
        checked = [k for k in mine if k != "use" and k not in cls.free_options]
    if not checked:
        return
    def resolved(values: dict) -> dict:  # every option, defaults filled in, as the run would use it
        options = {k: v for k, v in values.items() if k != "use"}
        return validate_options(options_cls, options, table, base_dir, plugin).model_dump(mode="json")

    was, now = resolved(theirs), resolved({**theirs, **mine})
    for key in checked:
        if was.get(key) != now.get(key):
            refuse(key, was.get(key), now.get(key), "shape" if table == "model" else f"{table} options")


# -- tokens ----------------------------------------------------------------------------------------

def tokenizer_dir(variant) -> Path | None:
    """Where the init's fitted tokenizer is (for the tokenizer plugin's ``load``); None without [init]."""
    return variant.init_source.tokenizer_dir if variant.init_source is not None else None


def tokenizer_digest(variant, tokenizer=None) -> str | None:
    """SHA-256 of the init's fitted tokenizer as the tokenizer plugin saves it (part of the token
    cache's key: two inits whose tokenizers differ never share tokens); None without [init]. The
    init's tokenizer is loaded into ``tokenizer`` (the variant's instance; a new one by default)."""
    directory = tokenizer_dir(variant)
    if directory is None:
        return None
    tokenizer = tokenizer if tokenizer is not None else variant.instantiate("tokenizer")
    tokenizer.load(directory)
    digest = hashlib.sha256()
    with tempfile.TemporaryDirectory(prefix="lmlab-tokenizer-") as tmp:
        tokenizer.save(Path(tmp))
        for path in sorted(p for p in Path(tmp).rglob("*") if p.is_file()):
            digest.update(f"{path.relative_to(tmp)}\0".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


# -- weights ---------------------------------------------------------------------------------------

def initialise(variant, model, run_dir: Path | None = None, resuming: bool = False) -> dict | None:
    """Load the [init]'s weights into ``model`` (just built, not yet wrapped or sharded) and return the
    record of where they came from; None without [init]. ``resuming``: the run continues from its own
    last.ckpt, so nothing is loaded and the record is the one written when it started."""
    source = variant.init_source
    if source is None:
        return None
    if resuming:
        recorded = _recorded(run_dir)
        return recorded if recorded else {"from": str(source.path), "format": source.kind,
                                          "weights": [{"path": str(p)} for p in source.weights]}
    step = None
    if source.kind == RUN:
        from lmlab.checkpoint import model_state

        state, step = model_state(source.weights[0])
        _restructure_compressed(model, source.weights[0])
        their_block = source_tables(source)["model"].get("block_size")
    else:
        try:
            state = load_reader(source.reader).hf_state(source.folder)
        except ImportError as exc:
            raise UserError(f"reading Hugging Face weights needs the safetensors package ({exc}): "
                            "pip install safetensors", key="init.from") from None
        their_block = None  # RoPE, T5's relative buckets: no weight depends on the context length
    load_state(model, state, strict=variant.init.strict, their_block_size=their_block, source=source.path)
    record = {"from": str(source.path), "format": source.kind,
              "weights": [{"path": str(p), "sha256": sha256(p)} for p in source.weights]}
    if step is not None:
        record["step"] = step
    return record


def _restructure_compressed(model, checkpoint: Path) -> None:
    """An init that ``lmlab compress`` wrote: give the model the structure its methods left (quantised
    layers, pruned heads) before its weights load; the fine-tune's checkpoints carry the records on."""
    from lmlab.checkpoint import load
    from lmlab.compress.restore import KEY, restructure

    records = load(checkpoint, mmap=True).get(KEY)
    if records:
        restructure(model, records, checkpoint)


def load_state(model, state: dict, strict: bool = True, their_block_size: int | None = None,
               source: Path | str = "the init") -> None:
    """Copy ``state`` into ``model`` name by name; a UserError for a shape that differs (naming the
    parameter) or, when ``strict``, for a weight either side lacks (naming init.strict), except those
    the model starts itself (``init_missing``: heads an init trained without them does not hold), and
    either side's objective heads (``Objective.heads``). A
    position table sized by a larger ``their_block_size`` is cut to the model's block_size."""
    own = model.state_dict()
    block = model.shape.block_size
    fitted = {}
    for name, value in state.items():
        if name not in own:
            continue
        want = tuple(own[name].shape)
        if tuple(value.shape) != want:
            sized_by_block = (their_block_size is not None and value.dim() >= 1 and value.shape[0] == their_block_size
                              and want == (block, *value.shape[1:]))
            if sized_by_block and block < their_block_size:
                value = value[:block]  # positions past the new training window are never used
            elif sized_by_block:
                raise UserError(f"{block} is larger than the init's {their_block_size}, for which its {name} "
                                f"{tuple(value.shape)} was trained", key="model.block_size")
            else:
                raise UserError(f"{source}: its {name} has shape {tuple(value.shape)}, this model's {want}",
                                key="init.from")
        fitted[name] = value
    missing = [k for k in own if k not in fitted]
    unexpected = [k for k in state if k not in own]
    if missing and hasattr(model, "init_missing"):  # a model of the author's own class may lack it
        missing = model.init_missing(fitted, missing)
    # An objective's heads (Objective.heads) belong to the objective that trained them: this run's start
    # as the objective built them, and an init's that this run lacks are left behind (an SFT run
    # starting a reward model; a reward model starting a policy).
    missing = [k for k in missing if not k.startswith("heads.")]
    unexpected = [k for k in unexpected if not k.startswith("heads.")]
    if strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append(f"lacks {len(missing)} weight(s) this model has ({', '.join(missing[:4])}"
                         f"{', ...' if len(missing) > 4 else ''})")
        if unexpected:
            parts.append(f"holds {len(unexpected)} this model has not ({', '.join(unexpected[:4])}"
                         f"{', ...' if len(unexpected) > 4 else ''})")
        raise UserError(f"the init ({source}) {' and '.join(parts)}; set init.strict = false to keep fresh "
                        "weights where the init has none", key="init.strict")
    model.load_state_dict(fitted, strict=False)


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _recorded(run_dir: Path | None) -> dict | None:
    if run_dir is None:
        return None
    try:
        return json.loads((run_dir / "provenance.json").read_text()).get("init")
    except (OSError, json.JSONDecodeError):
        return None
