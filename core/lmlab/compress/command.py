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
from lmlab.compress.restore import KEY
from lmlab.errors import UserError

WEIGHTS = Path("checkpoints") / "last.ckpt"


def compress(run_dir: Path, methods: list[Method], out: Path, *, calibration_file: Path | None = None,
             calibration_split: str = "val", windows: int = 128, seed: int = 0, device: str = "cpu", rounds: int = 3, log=print) -> dict:
    """Compress the run in ``run_dir`` into ``out``; returns the summary written there."""
    from lmlab.rundir import write_json
    from lmlab.trained import load_run, refuse_bidirectional

    started = time.perf_counter()
    run_dir = Path(run_dir)
    if out.exists() and any(out.iterdir()):
        raise UserError("exists and is not empty; name a new folder (nothing was written)", key=str(out))
    try:
        run = load_run(run_dir)
    except UserError as exc:
        if not (exc.key or "").startswith("data."):
            raise
        # The run's data is how the compressed run is scored (its validation split) and, by default,
        # calibrated: say so, rather than only that a file is missing.
        raise UserError(f"{exc.message}; lmlab compress scores the compressed run on the run's validation split "
                        "(and calibrates on it without --calibration FILE): restore the run's data",
                        key=exc.key) from None
    refuse_bidirectional(run.objective)
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
    else:
        # The validation split by default (what the run's users hold out anyway); "train" keeps the
        # reported validation perplexity free of anything a calibrated search fitted to it.
        source = tokens.val if calibration_split == "val" else tokens.train
        calibration = calib.from_tokens(source, block, windows, seed, device)
        calibration_from = f"the run's {'validation' if calibration_split == 'val' else 'training'} split"
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
    staging = _write_folder(run, run_dir, model, records, methods, out)
    loaded = load_run(staging, ()).model.to(device).eval()  # what users of the new folder get
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
    summary = _summary(run, run_dir, records, before, after, loaded, calibration, calibration_from, started)
    summary["base"]["params"] = base_params
    write_json(staging / "summary.json", summary)
    staging.rename(out)  # the folder appears whole or not at all
    return summary


def _validation_tokens(run, methods: list[Method], calibration_file: Path | None):
    """The run's prepared tokens (from the token cache, or prepared again from its data), whose
    validation split the summary is measured on and, by default, the calibration drawn from."""
    from lmlab.prepare.tokens import load_tokens

    try:
        return load_tokens(run.variant, tokenizer=run.tokenizer)
    except UserError as exc:
        calibrated = [m.name for m in methods if m.plugin.calibrated]
        if calibrated and calibration_file is None:
            raise UserError(f"{', '.join(calibrated)} needs calibration data, and the run's validation split "
                            f"cannot be read ({exc}); pass --calibration FILE (text in the run's language)",
                            key="--calibration") from None
        raise UserError(f"the run's validation split cannot be read ({exc}); the compressed run is scored on it",
                        key="data.path") from None


def _write_folder(run, run_dir: Path, model, records: list[dict], methods: list[Method], out: Path) -> Path:
    """The new run folder, written next to ``out`` under a temporary name: manifest (the run's, with a
    [compress] table), fitted tokenizer, weights (the compressed state dict with the methods' records)."""
    from lmlab.rundir import atomic_write_bytes, toml_text
    from lmlab.tables import read_toml

    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)  # left by an interrupted compression
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
    return staging


def _summary(run, run_dir, records, before, after, loaded, calibration, calibration_from, started) -> dict:
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
        "calibration": {"from": calibration_from, "windows": len(calibration.windows), "tokens": calibration.tokens},
        "generation": {"prompts": measure.PROMPTS, "prompt_tokens": measure.PROMPT_TOKENS,
                       "new_tokens": measure.NEW_TOKENS, "batch": 1, "decoder": run.plugins["decoding"].name},
        "plugins": plugins,
        "wall_s": time.perf_counter() - started,
    }
