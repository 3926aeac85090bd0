"""``lmlab compress RUN_DIR --use METHOD``: the trained run loaded, measured, compressed by each method in
turn, written as a new run folder, loaded back from it and measured again, in one process so the
figures of the two compare (same split, same prompts, same machine load)."""

import copy
import io
import json
import shutil
import time
from pathlib import Path

import torch

from lmlab.compress import calibration as calib
from lmlab.compress import measure
from lmlab.compress.methods import Method
from lmlab.compress.restore import KEY, PARTIAL
from lmlab.errors import UserError

WEIGHTS = Path("checkpoints") / "last.ckpt"


def compress(run_dir: Path, methods: list[Method], out: Path, *, calibration_file: Path | None = None,
             calibration_split: str = "train", windows: int = 128, seed: int = 0, device: str = "cpu", rounds: int = 3,
             log=print) -> dict:
    """Compress the run in ``run_dir`` into ``out``; returns the summary written there."""
    from lmlab.api.architecture import ENCODER_DECODER
    from lmlab.model import family
    from lmlab.rundir import write_json
    from lmlab.trained import load_run, refuse_bidirectional

    started = time.perf_counter()
    run_dir = Path(run_dir)
    _check_out(out)
    device = _device(device)
    _refuse_compressed(run_dir)
    try:
        run = load_run(run_dir)
    except UserError as exc:
        if not (exc.key or "").startswith("data."):
            raise
        # The run's data is how the compressed run is scored (its validation split) and, by default,
        # calibrated: say so, rather than only that a file is missing.
        raise UserError(f"{exc.message}; lmlab compress scores the compressed run on the run's validation split "
                        "(and calibrates on its training split without --calibration FILE): restore the run's data",
                        key=exc.key) from None
    refuse_bidirectional(run.objective)
    if family(run.plugins["architecture"], run.objective) == ENCODER_DECODER:
        # Its forward takes the encoder's ids too, which neither the calibration windows nor the
        # methods' per-layer measurements supply.
        raise UserError("is an encoder-decoder run ([architecture]); lmlab compress compresses decoder-only "
                        "runs", key=str(run_dir))
    model = run.model.to(device).float().eval()
    if run.peft is not None:
        # A PEFT run is compressed as lmlab merge would leave it, the adapter folded into the base (what a
        # deployment quantises); the new folder is a plain run, without the [peft] table.
        with torch.no_grad():
            run.peft.merge(model)
    variant, block = run.variant, run.shape.block_size
    tokens = _validation_tokens(run, methods, calibration_file)
    if calibration_file is not None:
        calibration = calib.from_file(calibration_file, run.tokenizer, block, windows, seed, device)
        calibration_from = str(calibration_file)
        calibration_record = {"file": str(Path(calibration_file).resolve()), "split": None}
    else:
        # The training split by default: the reported perplexity is on the validation split, which a
        # calibrated search (AWQ's scales, Wanda's norms) must not have fitted to. "val" is for a run
        # whose training data is no longer at hand; its figures are then optimistic.
        source = tokens.val if calibration_split == "val" else tokens.train
        calibration = calib.from_tokens(source, block, windows, seed, device)
        calibration_from = f"the run's {'validation' if calibration_split == 'val' else 'training'} split"
        calibration_record = {"file": None, "split": calibration_split}
    calibration_record.update({"from": calibration_from, "seed": seed})
    cfg = variant.train
    batch = cfg.eval_batch_size or 4 * cfg.batch_size
    decoder = run.plugins["decoding"]
    prompts = measure.prompt_set(tokens.val)

    def figures(m, disk: int) -> measure.Figures:
        return measure.Figures(measure.validation_loss(m, run.objective, tokens, block, batch, variant.seed),
                               measure.memory_bytes(m), disk, tokens_per_s=0.0)

    for method in methods:  # bad settings cost no calibration and leave no folder
        method.plugin.check_model(model)
    log(f"measuring {run_dir} before compression")
    before = figures(model, measure.state_bytes(model.state_dict()))
    base_params = measure.weights(model)
    reference = copy.deepcopy(model)  # timed beside the compressed model at the end
    records = []
    for method in methods:
        log(f"{method.name}: compressing{' (calibrating on ' + calibration_from + ')' if method.plugin.calibrated else ''}")
        with torch.no_grad():
            record = method.plugin.compress(model, calibration if method.plugin.calibrated else None) or {}
        try:
            json.dumps(record)
        except (TypeError, ValueError) as exc:
            raise RuntimeError(f"compress plugin {method.name!r} returned a record that is not JSON: {exc}") from None
        records.append({"plugin": method.name, "options": method.options, "record": record})
    model.eval()
    probe = calibration.windows[:2, :-1]
    with torch.no_grad():
        expected = model(probe)
    staging = out.with_name(out.name + PARTIAL)
    try:
        _write_folder(run, run_dir, model, records, methods, staging)
        loaded = load_run(staging, (), unfinished_ok=True).model.to(device).eval()  # what users of the new folder get
        with torch.no_grad():
            got = loaded(probe)
        if not torch.equal(got, expected):
            raise RuntimeError(f"the compressed run does not reload to the same model (logits differ by up to "
                               f"{(got - expected).abs().max().item():.3g}): a method's restructure does not match "
                               "what its compress left")
        after = figures(loaded, (staging / WEIGHTS).stat().st_size)
        log("timing generation (the run and the compressed run, interleaved)")
        before.tokens_per_s, after.tokens_per_s = measure.generation_speed([reference, loaded], decoder, prompts,
                                                                           rounds=rounds)
        summary = _summary(run, run_dir, records, before, after, loaded, calibration, calibration_record, started)
        summary["base"]["params"] = base_params
        write_json(staging / "summary.json", summary)  # the completion marker (restore.unfinished)
        staging.rename(out)  # the folder appears whole or not at all
    except BaseException:
        # Ctrl-C, SIGTERM or a failure: nothing half-written stays behind (a kill -9 leaves the folder,
        # which loaders refuse and the next compress replaces).
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return summary


def _check_out(out: Path) -> None:
    """``out`` must be a new (or empty) folder whose parent can hold it."""
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} is a file; name a new folder (nothing was written)", key="--out")
    if out.is_dir() and any(out.iterdir()):
        raise UserError("exists and is not empty; name a new folder (nothing was written)", key=str(out))
    above = next((p for p in out.parents if p.exists()), None)
    if above is not None and not above.is_dir():
        raise UserError(f"{above} is a file, so {out} cannot be made (nothing was written)", key="--out")


def _device(text: str) -> torch.device:
    """The device named by --device, which must be here: refused before the run is loaded."""
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise UserError(f"{text!r} is not a device; name cpu, cuda (cuda:N) or mps", key="--device") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise UserError(f"{text!r}: no CUDA GPU is visible here; use --device cpu", key="--device")
        if device.index is not None and device.index >= count:
            raise UserError(f"{text!r}: this machine has {count} CUDA GPU(s) (cuda:0 to cuda:{count - 1})",
                            key="--device")
    elif device.type == "mps":
        if not torch.backends.mps.is_available():
            raise UserError(f"{text!r}: MPS is not available here; use --device cpu", key="--device")
    elif device.type != "cpu":
        raise UserError(f"{text!r}: lmlab compress runs on cpu, cuda or mps", key="--device")
    return device


def _refuse_compressed(run_dir: Path) -> None:
    """A compressed run is not compressed again: its methods' records would have to be chained with
    the new ones, and a method's layers (codes, pruned heads) are not what another method takes in."""
    from lmlab.tables import read_toml

    table = read_toml(run_dir / "manifest.toml").get("compress")
    if table is not None:
        used = table.get("use") if isinstance(table, dict) else None
        raise UserError(f"is already compressed ({', '.join(used) if isinstance(used, list) else 'lmlab compress'}); "
                        "compress the run it came from with the methods chained instead "
                        "(--use A --use B)", key=str(run_dir))


def _validation_tokens(run, methods: list[Method], calibration_file: Path | None):
    """The run's prepared tokens (from the token cache, or prepared again from its data), whose
    validation split the summary is measured on and whose training split, by default, calibrates."""
    from lmlab.prepare.tokens import load_tokens

    try:
        return load_tokens(run.variant, tokenizer=run.tokenizer)
    except UserError as exc:
        calibrated = [m.name for m in methods if m.plugin.calibrated]
        if calibrated and calibration_file is None:
            raise UserError(f"{', '.join(calibrated)} needs calibration data, and the run's token splits "
                            f"cannot be read ({exc}); pass --calibration FILE (text in the run's language)",
                            key="--calibration") from None
        raise UserError(f"the run's validation split cannot be read ({exc}); the compressed run is scored on it",
                        key="data.path") from None


def _write_folder(run, run_dir: Path, model, records: list[dict], methods: list[Method], staging: Path) -> None:
    """The new run folder, written in ``staging`` (the output's temporary name): manifest (the run's,
    with a [compress] table), fitted tokenizer, weights (the compressed state dict with the methods'
    records)."""
    from lmlab.rundir import atomic_write_bytes, toml_text
    from lmlab.tables import read_toml

    # Left by a compression killed outright (kill -9, power loss): replaced.
    if staging.is_symlink() or staging.is_file():
        staging.unlink()
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    manifest = read_toml(run_dir / "manifest.toml")
    manifest.pop("peft", None)  # merged before compressing (above)
    manifest["compress"] = {"use": [m.name for m in methods], **{m.name: m.options for m in methods}}
    manifest["description"] = (f"{manifest.get('description', manifest.get('name', ''))} — compressed with "
                               f"{' + '.join(m.label for m in methods)} from {run_dir}").strip(" —")
    atomic_write_bytes(staging / "manifest.toml", toml_text(manifest).encode())
    shutil.copytree(run_dir / "tokenizer", staging / "tokenizer")
    state = {f"model.{k}": v.detach().cpu() for k, v in model.state_dict().items()}
    checkpoint = {"state_dict": state, "global_step": run.step or 0, KEY: records}
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    (staging / "checkpoints").mkdir()
    atomic_write_bytes(staging / WEIGHTS, buffer.getvalue())


def _summary(run, run_dir, records, before, after, loaded, calibration, calibration_record, started) -> dict:
    from lmlab import discovery, provenance

    def ratio(a, b):
        return a / b if b else None

    plugins = provenance.plugins(run.variant)
    plugins["compress"] = [{"name": r["plugin"], "distribution": info.distribution, "version": info.version}
                           for r in records for info in [discovery.find("compress", r["plugin"], key="--use")]]
    methods = [{"plugin": r["plugin"], "options": r["options"], **(r["record"].get("summary") or {})} for r in records]
    return {
        "status": "completed",
        **after.as_dict(),
        "params": measure.weights(loaded),
        "steps": run.step or 0,
        "base": before.as_dict(),
        "disk_ratio": ratio(after.disk_bytes, before.disk_bytes),
        "memory_ratio": ratio(after.memory_bytes, before.memory_bytes),
        "speedup": ratio(after.tokens_per_s, before.tokens_per_s),
        "compress": methods,
        "source": str(Path(run_dir).resolve()),
        "merged_peft": run.peft.name if run.peft is not None else None,
        "calibration": {**calibration_record, "windows": len(calibration.windows), "tokens": calibration.tokens},
        "generation": dict(prompts=measure.PROMPTS, prompt_tokens=measure.PROMPT_TOKENS, new_tokens=measure.NEW_TOKENS,
                           batch=1, decoder=run.plugins["decoding"].name),
        "plugins": plugins,
        "wall_s": time.perf_counter() - started,
    }
