"""The windows a calibrated method measures the model on: by default drawn from the run's own
training split (the validation split, which the compressed run is scored on, stays held out), else
from a text file encoded by the run's tokenizer. Windows are the model's length, taken at seeded random offsets so they spread over the text."""

from pathlib import Path

import numpy as np
import torch

from lmlab.api import Calibration
from lmlab.errors import UserError


def from_tokens(tokens: np.ndarray, block_size: int, windows: int, seed: int, device,
                batch_size: int = 8) -> Calibration:
    """``windows`` windows of ``block_size + 1`` tokens of ``tokens`` (fewer when the text is short)."""
    span = block_size + 1
    if len(tokens) < span:
        raise ValueError(f"{len(tokens)} tokens are fewer than one window of {span}")
    rng = np.random.default_rng(seed)
    count = min(windows, len(tokens) // span)
    starts = np.sort(rng.choice(len(tokens) - span + 1, size=count, replace=False))
    rows = np.stack([np.asarray(tokens[s:s + span], dtype=np.int64) for s in starts])
    return Calibration(torch.from_numpy(rows).to(device), batch_size=batch_size)


def from_file(path: Path, tokenizer, block_size: int, windows: int, seed: int, device) -> Calibration:
    """Windows of a text file, encoded by the run's tokenizer; a UserError naming the file when it is
    missing, unreadable or shorter than one window."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError("no such file", key=str(path)) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot be read as UTF-8 text ({type(exc).__name__})", key=str(path)) from None
    try:
        tokens = np.asarray(tokenizer.encode(text), dtype=np.int64)
    except UserError as exc:
        # The tokenizer names its own option (tokenizer.unknown), which compress does not take: the
        # file is what to change.
        raise UserError(f"--calibration: the run's tokenizer cannot encode this text ({exc.message})",
                        key=str(path)) from None
    if len(tokens) < block_size + 1:
        raise UserError(f"holds {len(tokens)} tokens; calibration needs at least one window of {block_size + 1}",
                        key=str(path))
    return from_tokens(tokens, block_size, windows, seed, device)
