"""Loading trained weights from a run folder (never unpickling arbitrary objects)."""

from pathlib import Path

import torch

from lmlab.errors import UserError


def best_or_last(run_dir: Path) -> Path:
    for name in ("best.ckpt", "last.ckpt"):
        path = run_dir / "checkpoints" / name
        if path.is_file():
            return path
    raise UserError("holds no checkpoints/best.ckpt or last.ckpt", key=str(run_dir))


def load_model_weights(model: torch.nn.Module, path: Path) -> int:
    """Load the LanguageModel weights of a Lightning checkpoint; returns its global step."""
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    prefix = "model."
    state = {k[len(prefix):]: v for k, v in checkpoint["state_dict"].items() if k.startswith(prefix)}
    state = {k.replace("_orig_mod.", ""): v for k, v in state.items()}  # saved from a compiled model
    model.load_state_dict(state)
    return int(checkpoint.get("global_step", 0))
