"""Checkpoint files of a run folder: which are readable, which to resume or load from, and loading
their weights (never unpickling arbitrary objects).

A checkpoint is torch's zip format, which stores a CRC-32 per member: :func:`problem` reads the
whole file and checks them, so a file cut short (a full disk, a copy that stopped) or damaged on
disk is told apart from a good one before anything relies on it. The recorder checks every file it
writes before it replaces the previous one; resuming and loading skip files that fail the check, with
a warning, in favour of the next best. Torch is imported only where weights are read, so the sweep
planner (which only asks whether a readable checkpoint exists) stays light.
"""

import zipfile
from pathlib import Path

from lmlab.errors import UserError, warn

LAST, BEST = "last.ckpt", "best.ckpt"


def problem(path: Path, deep: bool = True) -> str | None:
    """Why ``path`` is not a complete checkpoint file, or None when it is one. ``deep=False`` reads only
    the archive's directory (at its end: a file cut short fails), not every member's checksum."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return "it does not exist"
    except OSError as exc:
        return f"it cannot be read ({exc.strerror})"
    if path.is_dir():  # a sharded (distributed) checkpoint: its strategy checks its own files
        return None
    if size == 0:
        return "it is empty (0 bytes)"
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip() if deep else None
    except (zipfile.BadZipFile, EOFError, ValueError):
        return f"it is cut short or not a checkpoint ({size:,} bytes, no complete archive)"
    except OSError as exc:
        return f"it cannot be read ({exc.strerror})"
    if bad is not None:
        return f"it is damaged ({bad} fails its checksum)"
    return None


def readable(run_dir: Path, names=(LAST, BEST)) -> tuple[list[Path], list[str]]:
    """The checkpoint files of ``run_dir`` among ``names`` that pass :func:`problem`, in that order,
    and one line for each present one that does not."""
    good, bad = [], []
    for name in names:
        path = Path(run_dir) / "checkpoints" / name
        if not path.exists():
            continue
        why = problem(path)
        if why is None:
            good.append(path)
        else:
            bad.append(f"{path} is unreadable: {why}")
    return good, bad


def resume_point(run_dir: Path) -> Path | None:
    """The newest readable checkpoint of the run to resume from (by global step; last.ckpt on a tie),
    warning about each unreadable one; None when none is readable."""
    good, bad = readable(run_dir)
    for line in bad:
        warn(line)
    if not good:
        return None
    chosen = max(good, key=lambda p: (step_of(p), p.name == LAST))
    if chosen.name != LAST:
        warn(f"resuming from {chosen} (step {step_of(chosen)}) instead")
    return chosen


def best_or_last(run_dir: Path) -> Path:
    """The checkpoint a trained run is used from: best.ckpt, else last.ckpt (with a warning when best.ckpt
    is there but unreadable); a UserError naming the run when neither is readable."""
    good, bad = readable(run_dir, (BEST, LAST))
    if good:
        for line in bad:
            warn(f"{line}; using {good[0].name}")
        return good[0]
    if bad:
        raise UserError("has no readable checkpoint: " + "; ".join(bad), key=str(run_dir))
    raise UserError("holds no checkpoints/best.ckpt or last.ckpt", key=str(run_dir))


def load(path: Path, mmap: bool = False) -> dict:
    """A checkpoint's contents (tensors and plain values only), or a UserError naming the file."""
    import pickle

    import torch

    why = None if mmap else problem(path)
    if why is None:
        try:
            checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
        except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as exc:
            why = f"it cannot be loaded ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        else:
            if isinstance(checkpoint, dict):
                return checkpoint
            why = f"it holds a {type(checkpoint).__name__}, not a checkpoint"
    raise UserError(f"is not a usable checkpoint: {why}", key=str(path))


def step_of(path: Path) -> int:
    """The global step a checkpoint was written at (reads its small entries only)."""
    return int(load(path, mmap=True).get("global_step", 0))


def model_state(path: Path) -> tuple[dict, int]:
    """The LanguageModel state dict of a Lightning checkpoint, and its global step."""
    checkpoint = load(path)
    if "lmlab_peft" in checkpoint:  # adapter entries only (lmlab.train.adapters)
        raise UserError(f"holds only a {checkpoint['lmlab_peft']['plugin']} adapter, not a whole model; fold it "
                        f"into the base weights first: lmlab merge {path.parent.parent}", key=str(path))
    if "state_dict" not in checkpoint:
        raise UserError("is not a Lightning checkpoint (it has no state_dict)", key=str(path))
    return state_of(checkpoint), int(checkpoint.get("global_step", 0))


def state_of(checkpoint: dict) -> dict:
    """The LanguageModel entries of a loaded Lightning checkpoint's state dict."""
    prefix = "model."
    state = {k[len(prefix):]: v for k, v in checkpoint["state_dict"].items() if k.startswith(prefix)}
    return {k.replace("_orig_mod.", ""): v for k, v in state.items()}  # saved from a compiled model
